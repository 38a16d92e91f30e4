#!/usr/bin/env bash
# Build etcd, kube-apiserver, kube-controller-manager and kubectl from Go modules into a cache directory,
# once per pinned version. Prints the directory holding the binaries (envtest's KUBEBUILDER_ASSETS).
# Arguments name more commands of k8s.io/kubernetes to build into the same directory (the test
# cluster adds kube-scheduler, kubelet and kube-proxy: build-cluster.sh).
#
# k8s.io/kubernetes requires its staging modules at v0.0.0 with replace directives to ./staging,
# which a dependent module ignores; so a throwaway module pins each staging module to the matching
# v0.N.P release (read from the downloaded go.mod, never hard-coded). etcd's server module is built
# the same way.
set -euo pipefail

K8S_VERSION="${IMPVM_K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${IMPVM_ETCD_VERSION:-v3.6.16}"
CACHE_ROOT="${IMPVM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/impvm}/control-plane"
OUT="$CACHE_ROOT/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}"

K8S_BINARIES=(kube-apiserver kube-controller-manager kubectl "$@")
have_all=1
for b in etcd "${K8S_BINARIES[@]}"; do
  [[ -x "$OUT/$b" ]] || have_all=0
done
if ((have_all)); then
  echo "$OUT"
  exit 0
fi
# IMPVM_CHECK_ONLY: only say (exit 1) that a build is needed
[[ -n "${IMPVM_CHECK_ONLY:-}" ]] && exit 1

mkdir -p "$OUT"
export GOFLAGS="-mod=mod"
export CGO_ENABLED=0
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

log() { echo "build-control-plane: $*" >&2; }

# --- the k8s.io/kubernetes commands ------------------------------------------------------------
minor="${K8S_VERSION#v1.}"   # 34.4
staging_version="v0.${minor}"
mkdir -p "$work/k8s"
cd "$work/k8s"
go mod init impvm.local/k8sbuild >/dev/null 2>&1
gomod="$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
{
  echo "require k8s.io/kubernetes ${K8S_VERSION}"
  # every "k8s.io/x => ./staging/src/k8s.io/x" line becomes a replace to its release
  grep -E '^\s*k8s\.io/[A-Za-z0-9._/-]+ => \./staging/' "$gomod" | awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
} >> go.mod
log "resolving k8s.io/kubernetes ${K8S_VERSION} (staging ${staging_version})"
{
  printf '//go:build tools\n\npackage tools\n\nimport (\n'
  for b in "${K8S_BINARIES[@]}"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$b"; done
  printf ')\n'
} > tools.go
go mod tidy >&2
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor%%.*}"
# each binary is built only when missing, and moved into place only when complete
for b in "${K8S_BINARIES[@]}"; do
  [[ -x "$OUT/$b" ]] && continue
  log "building $b"
  go build -trimpath -ldflags "$ldflags" -o "$OUT/$b.tmp" "k8s.io/kubernetes/cmd/$b"
  mv "$OUT/$b.tmp" "$OUT/$b"
done

# --- etcd ----------------------------------------------------------------------------------------
mkdir -p "$work/etcd"
cd "$work/etcd"
go mod init impvm.local/etcdbuild >/dev/null 2>&1
echo "require go.etcd.io/etcd/server/v3 ${ETCD_VERSION}" >> go.mod
cat > tools.go <<'GO'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
GO
go mod tidy >&2
if [[ ! -x "$OUT/etcd" ]]; then
  log "building etcd ${ETCD_VERSION}"
  go build -trimpath -ldflags "-s -w" -o "$OUT/etcd.tmp" go.etcd.io/etcd/server/v3
  mv "$OUT/etcd.tmp" "$OUT/etcd"
fi
echo "$OUT"
