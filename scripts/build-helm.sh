#!/usr/bin/env bash
# Build the helm CLI from its Go module (helm.sh/helm/v3) into a cache directory, once per pinned
# version, the way scripts/setup.sh builds the control plane. Prints the path of the binary.
#
# A throwaway module requires helm.sh/helm/v3 at the pinned version (helm's go.mod has no replace
# directives, so the module graph is the one helm's own release uses) and builds cmd/helm with the
# ldflags helm's Makefile sets: the version, and the Kubernetes version helm assumes when it has no
# cluster (`helm template`, `helm lint`), derived from the k8s.io/client-go it is built with.
set -euo pipefail

HELM_VERSION="${IMPVM_HELM_VERSION:-v3.22.0}"
CACHE_ROOT="${IMPVM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/impvm}/helm"
OUT="$CACHE_ROOT/$HELM_VERSION"

if [[ -x "$OUT/helm" ]]; then
  echo "$OUT/helm"
  exit 0
fi
log() { echo "build-helm: $*" >&2; }

mkdir -p "$OUT"
export GOFLAGS="-mod=mod"
export CGO_ENABLED=0
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
go mod init impvm.local/helmbuild >/dev/null 2>&1
echo "require helm.sh/helm/v3 ${HELM_VERSION}" >> go.mod
cat > tools.go <<'GO'
//go:build tools

package tools

import _ "helm.sh/helm/v3/cmd/helm"
GO
log "resolving helm.sh/helm/v3 ${HELM_VERSION}"
go mod tidy >&2
client_go="$(go list -m -f '{{.Version}}' k8s.io/client-go)"   # v0.37.0
IFS=. read -r cg_major cg_minor _ <<<"${client_go#v}"
k8s_major=$((cg_major + 1))
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} -X helm.sh/helm/v3/internal/version.metadata="
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags+=" -X ${pkg}.k8sVersionMajor=${k8s_major} -X ${pkg}.k8sVersionMinor=${cg_minor}"
done
log "building helm ${HELM_VERSION} (client-go ${client_go})"
go build -trimpath -ldflags "$ldflags" -o "$OUT/helm.tmp" helm.sh/helm/v3/cmd/helm
mv "$OUT/helm.tmp" "$OUT/helm"
echo "$OUT/helm"
