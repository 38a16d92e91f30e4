#!/usr/bin/env bash
# Generate the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) from its Go
# API types with controller-gen, the way the Prometheus Operator generates its own CRDs, into a
# cache directory, once per pinned version. Prints the path of the CRD file. The chart tests
# install it to check the chart's optional ServiceMonitor on the real API server.
set -euo pipefail

PO_VERSION="${IMPVM_PROMETHEUS_OPERATOR_VERSION:-v0.95.2}"
CONTROLLER_TOOLS_VERSION="${IMPVM_CONTROLLER_TOOLS_VERSION:-v0.23.0}"
CACHE_ROOT="${IMPVM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/impvm}/crds"
OUT="$CACHE_ROOT/prometheus-operator-$PO_VERSION"
CRD="$OUT/monitoring.coreos.com_servicemonitors.yaml"

if [[ -s "$CRD" ]]; then
  echo "$CRD"
  exit 0
fi
log() { echo "build-servicemonitor-crd: $*" >&2; }

mkdir -p "$OUT"
export GOFLAGS="-mod=mod"
export CGO_ENABLED=0
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
go mod init impvm.local/crdgen >/dev/null 2>&1
{
  echo "require github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring ${PO_VERSION}"
  echo "require sigs.k8s.io/controller-tools ${CONTROLLER_TOOLS_VERSION}"
} >> go.mod
cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	_ "sigs.k8s.io/controller-tools/cmd/controller-gen"
)
GO
log "resolving prometheus-operator ${PO_VERSION}, controller-tools ${CONTROLLER_TOOLS_VERSION}"
go mod tidy >&2
log "building controller-gen"
go build -o "$work/controller-gen" sigs.k8s.io/controller-tools/cmd/controller-gen
log "generating the monitoring.coreos.com CRDs"
"$work/controller-gen" crd:crdVersions=v1 \
  paths=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1 \
  output:crd:dir="$work/crds" >&2
cp "$work/crds/monitoring.coreos.com_servicemonitors.yaml" "$CRD.tmp"
mv "$CRD.tmp" "$CRD"
echo "$CRD"
