#!/usr/bin/env bash
# Install what impvm needs on a fresh Debian 12 machine, idempotently: Debian packages, a Python
# 3.11 venv with the pinned dependencies, the npm fixtures, and the control-plane binaries (built
# once from Go modules into ~/.cache/impvm, or KUBEBUILDER_ASSETS). Prints the control plane's
# directory on stdout and nothing but progress on stderr; safe to run repeatedly.
#
#   bash scripts/setup.sh [stack|tests]
#
# `stack` (scripts/dev-up.sh) builds only what the embedded stack runs; `tests` (the default:
# scripts/test.sh, .ci/run) adds what the tests use besides: cosign (signed-image tests), helm and
# the ServiceMonitor CRD (chart tests) and the test cluster's binaries. The control plane's Go
# build runs beside the Python install. Estimates are this project's own measurements on a 2-core
# machine with an empty Go cache (README, "The two commands"; the cluster's: docs/test-cluster.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE="${1:-tests}"
case "$PROFILE" in
  stack|tests) ;;
  *) echo "setup: unknown profile '$PROFILE' (stack or tests)" >&2; exit 2 ;;
esac
log() { echo "setup: $*" >&2; }
started=$SECONDS
# step NAME ESTIMATE COMMAND...: run a step that may take long, saying how long it should take
# and how long it took
step() {
  local name="$1" estimate="$2" t0=$SECONDS
  shift 2
  log "$name (about $estimate when not cached) ..."
  "$@"
  (( SECONDS - t0 > 10 )) && log "$name done in $((SECONDS - t0))s"
  return 0
}

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

# the control plane's Go build needs only Go and python3, not the venv: it runs meanwhile
cp_log="$(mktemp)"
cp_pid=""
if [[ -z "${KUBEBUILDER_ASSETS:-}" ]] && ! IMPVM_CHECK_ONLY=1 bash src/impvm/kube/assets/build-control-plane.sh >/dev/null 2>&1; then
  log "control plane: etcd, kube-apiserver, kube-controller-manager, kubectl from Go modules (first time only; about 7 min on 2 cores, in the background)"
  ( t0=$SECONDS; bash src/impvm/kube/assets/build-control-plane.sh >"$cp_log.out" 2>"$cp_log"; rc=$?; echo "$((SECONDS - t0))" >"$cp_log.secs"; exit $rc ) &
  cp_pid=$!
fi

wait_control_plane() {
  if [[ -n "$cp_pid" ]]; then
    log "waiting for the control plane build ..."
    if ! wait "$cp_pid"; then
      cat "$cp_log" >&2
      log "the control plane build failed"
      exit 1
    fi
    log "control plane built in $(cat "$cp_log.secs")s"
    KUBEBUILDER_ASSETS="$(tail -n1 "$cp_log.out")"
  fi
  cp_pid=""
}

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

if [[ "$PROFILE" == tests ]]; then
  # cosign: the agent verifies signed images with it, the signed-image tests sign with it
  if ! IMPVM_COSIGN_CHECK_ONLY=1 bash src/impvm/signing/assets/build-cosign.sh >/dev/null 2>&1; then
    step "cosign from Go modules" "20 min" bash -c 'bash src/impvm/signing/assets/build-cosign.sh >/dev/null'
  fi
  step "helm and the ServiceMonitor CRD for the chart tests" "4 min" \
    bash -c 'bash scripts/build-helm.sh >/dev/null && bash scripts/build-servicemonitor-crd.sh >/dev/null'
  wait_control_plane  # the cluster's binaries are built into the same directory
  if [[ -z "${IMPVM_CLUSTER_ASSETS:-}" ]]; then
    step "test cluster binaries: kubelet, kube-scheduler, kube-proxy, CoreDNS, pause" "6 min" \
      bash -c 'bash src/impvm/devstack/assets/build-cluster.sh >/dev/null'
  fi
fi

wait_control_plane
rm -f "$cp_log" "$cp_log.out" "$cp_log.secs"
if [[ -z "${KUBEBUILDER_ASSETS:-}" ]]; then
  KUBEBUILDER_ASSETS="$(bash src/impvm/kube/assets/build-control-plane.sh)"
fi
(( SECONDS - started > 10 )) && log "setup ($PROFILE) took $((SECONDS - started))s"
echo "$KUBEBUILDER_ASSETS"
