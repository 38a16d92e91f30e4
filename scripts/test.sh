#!/usr/bin/env bash
# The test command: set everything up (scripts/setup.sh) and run the whole test suite against a
# real control plane and the GitHub stand-in. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
KUBEBUILDER_ASSETS="$(bash scripts/setup.sh)"
export KUBEBUILDER_ASSETS
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
