#!/usr/bin/env bash
# Build what the test cluster runs beyond the control plane, once per pinned version, and print
# the directory holding every binary: the control plane (impvm/kube/assets/build-control-plane.sh) plus
# kube-scheduler, kubelet and kube-proxy from the same k8s.io/kubernetes module, CoreDNS from its
# Go module (github.com/coredns/coredns, whose go.mod has no replace directives, so a throwaway
# module that requires it builds the release's own module graph), and the pod sandbox's pause
# program compiled from the C source k8s.io/kubernetes ships (build/pause/linux/pause.c), static.
#
# The directory (~/.cache/impvm/cluster/k8s-V-etcd-V-coredns-V) links the control plane's binaries
# and holds coredns and pause, so one path names one set of versions.
set -euo pipefail

K8S_VERSION="${IMPVM_K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${IMPVM_ETCD_VERSION:-v3.6.16}"
COREDNS_VERSION="${IMPVM_COREDNS_VERSION:-v1.14.7}"
CACHE_BASE="${IMPVM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/impvm}"
OUT="$CACHE_BASE/cluster/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}-coredns-${COREDNS_VERSION}"
K8S_EXTRA=(kube-scheduler kubelet kube-proxy)
ALL=(etcd kube-apiserver kube-controller-manager kubectl "${K8S_EXTRA[@]}" coredns pause)

have_all=1
for b in "${ALL[@]}"; do
  [[ -x "$OUT/$b" ]] || have_all=0
done
if ((have_all)); then
  echo "$OUT"
  exit 0
fi
log() { echo "build-cluster: $*" >&2; }

here="$(cd "$(dirname "$0")" && pwd)"
cp_dir="$(IMPVM_K8S_VERSION="$K8S_VERSION" IMPVM_ETCD_VERSION="$ETCD_VERSION" bash "$here/../../kube/assets/build-control-plane.sh" "${K8S_EXTRA[@]}")"
mkdir -p "$OUT"
for b in etcd kube-apiserver kube-controller-manager kubectl "${K8S_EXTRA[@]}"; do
  ln -sfn "$cp_dir/$b" "$OUT/$b"
done

export GOFLAGS="-mod=mod"
export CGO_ENABLED=0
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# --- CoreDNS ---------------------------------------------------------------------------------
if [[ ! -x "$OUT/coredns" ]]; then
  mkdir -p "$work/coredns"
  cd "$work/coredns"
  go mod init impvm.local/corednsbuild >/dev/null 2>&1
  echo "require github.com/coredns/coredns ${COREDNS_VERSION}" >> go.mod
  cat > tools.go <<'GO'
//go:build tools

package tools

import _ "github.com/coredns/coredns"
GO
  log "resolving github.com/coredns/coredns ${COREDNS_VERSION}"
  go mod tidy >&2
  log "building coredns ${COREDNS_VERSION}"
  go build -trimpath -ldflags "-s -w" -o "$OUT/coredns.tmp" github.com/coredns/coredns
  mv "$OUT/coredns.tmp" "$OUT/coredns"
fi

# --- pause -------------------------------------------------------------------------------------
if [[ ! -x "$OUT/pause" ]]; then
  src="$(go env GOMODCACHE)/k8s.io/kubernetes@${K8S_VERSION}/build/pause/linux/pause.c"
  if [[ ! -f "$src" ]]; then
    go mod download "k8s.io/kubernetes@${K8S_VERSION}" >&2
  fi
  log "compiling pause from $src"
  cc -Os -Wall -Werror -static -DVERSION="${K8S_VERSION}-impvm" -o "$OUT/pause.tmp" "$src"
  strip "$OUT/pause.tmp"
  mv "$OUT/pause.tmp" "$OUT/pause"
fi
echo "$OUT"
