#!/usr/bin/env bash
# Install everything impvm's stack and tests need on a fresh Debian 12 machine, idempotently:
# Debian packages, a Python 3.11 venv with the pinned dependencies, the npm fixtures, and the
# control-plane binaries (built once from Go modules into ~/.cache/impvm, or KUBEBUILDER_ASSETS).
# Prints nothing but progress on stderr; safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "setup: $*" >&2; }

# Debian packages the runtimes and tests use: bubblewrap (process runtime sandbox), skopeo +
# umoci (pull, unpack and assemble OCI images), docker-registry (loopback registry),
# busybox-static (test images, guest initramfs), nftables + iproute2 + util-linux's nsenter (each
# VM's own network and its egress policy), dnsmasq-base (the network tests' resolver in their
# "internet" namespace), mmdebstrap (the images' Debian roots), podman + runc (run the built images
# in the tests), containerd + containernetworking-plugins + gcc and libc6-dev (the test cluster's
# nodes; its pod sandbox program is compiled static).
DEB_PACKAGES=(bubblewrap skopeo umoci docker-registry busybox-static qemu-system-x86 linux-image-amd64 linux-image-cloud-amd64 e2fsprogs nftables iproute2 util-linux dnsmasq-base mmdebstrap podman runc tmux containerd containernetworking-plugins gcc libc6-dev)
missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

PY="${IMPVM_PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv with $PY"
  "$PY" -m venv .venv
fi
if ! cmp -s constraints.txt .venv/.constraints 2>/dev/null || ! cmp -s pyproject.toml .venv/.pyproject 2>/dev/null; then
  log "installing Python dependencies (pinned in pyproject.toml and constraints.txt)"
  .venv/bin/python -m pip install -q --upgrade "pip==26.3" >&2
  .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]' >&2
  cp constraints.txt .venv/.constraints
  cp pyproject.toml .venv/.pyproject
fi

if [[ -f tools/npm/package-lock.json ]] && ! cmp -s tools/npm/package-lock.json tools/npm/node_modules/.impvm-installed 2>/dev/null; then
  log "installing npm fixtures"
  npm ci --prefix tools/npm --no-audit --no-fund --loglevel=error >&2
  cp tools/npm/package-lock.json tools/npm/node_modules/.impvm-installed
fi

# cosign: the agent verifies signed images with it, tests sign with it (built once, cached)
if ! IMPVM_COSIGN_CHECK_ONLY=1 bash src/impvm/devstack/assets/build-cosign.sh >/dev/null 2>&1; then
  log "cosign (built once, cached)"
  bash src/impvm/devstack/assets/build-cosign.sh >/dev/null
fi

log "helm and the ServiceMonitor CRD for the chart tests (built once from Go modules, cached)"
bash scripts/build-helm.sh >/dev/null
bash scripts/build-servicemonitor-crd.sh >/dev/null

if [[ -z "${IMPVM_CLUSTER_ASSETS:-}" ]]; then
  log "test cluster binaries: kubelet, kube-scheduler, kube-proxy, CoreDNS, pause (built once, cached)"
  bash src/impvm/devstack/assets/build-cluster.sh >/dev/null
fi

if [[ -z "${KUBEBUILDER_ASSETS:-}" ]]; then
  log "control plane binaries (built once, cached)"
  KUBEBUILDER_ASSETS="$(bash src/impvm/devstack/assets/build-control-plane.sh)"
fi
echo "$KUBEBUILDER_ASSETS"
