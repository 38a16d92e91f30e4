#!/usr/bin/env bash
# Start or stop the test cluster (docs/test-cluster.md): a real multi-node Kubernetes cluster on
# this machine, each node a network namespace with containerd, kubelet and kube-proxy.
#   bash scripts/cluster.sh up [--name N] [--nodes K]   # prints KUBECONFIG=... and more
#   bash scripts/cluster.sh down [--name N]
# Needs root. The binaries are built once from Go modules into ~/.cache/impvm/cluster/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
exec .venv/bin/python -m impvm.devstack.cluster "$@"
