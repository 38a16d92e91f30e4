{{/* Names, labels and images shared by every template. */}}

{{- define "impvm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name: the release name when it already contains the chart name
(`helm install impvm ...` gives impvm-operator, impvm-agent, as deploy/rbac names them). */}}
{{- define "impvm.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "impvm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "impvm.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object; call with (dict "root" $ "component" "operator"). */}}
{{- define "impvm.labels" -}}
{{ include "impvm.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* An image reference: repository@digest when a digest is given (immutable, the way a runner
fleet should pull), else repository:tag (tag defaults to the chart's appVersion). */}}
{{- define "impvm.image" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository (default .appVersion .tag) -}}
{{- end -}}
{{- end -}}

{{/* The RBAC rules of one component, read from files/rbac/<component>.yaml: a verbatim copy of
deploy/rbac/<component>.yaml (tests fail when they differ), so the chart and the plain manifests
grant exactly the same. Call with (dict "root" $ "component" "agent" "kind" "Role"). */}}
{{- define "impvm.rbacRules" -}}
{{- $file := printf "files/rbac/%s.yaml" .component -}}
{{- $text := .root.Files.Get $file -}}
{{- if not $text -}}{{- fail (printf "%s is missing from the chart" $file) -}}{{- end -}}
{{- $found := false -}}
{{- range $doc := regexSplit "(?m)^---\\s*$" $text -1 -}}
{{- $obj := fromYaml $doc -}}
{{- if and $obj (eq (get $obj "kind") $.kind) (not $found) -}}
{{- $found = true -}}
{{- toYaml (get $obj "rules") -}}
{{- end -}}
{{- end -}}
{{- if not $found -}}{{- fail (printf "%s has no %s" $file .kind) -}}{{- end -}}
{{- end -}}
