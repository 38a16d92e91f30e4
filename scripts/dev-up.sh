#!/usr/bin/env bash
# The embedded stack: set everything up (scripts/setup.sh) and run `impvm dev up`.
# Extra arguments go to `impvm dev up` (e.g. --jobs 3 --until-done).
set -euo pipefail
cd "$(dirname "$0")/.."
KUBEBUILDER_ASSETS="$(bash scripts/setup.sh)"
export KUBEBUILDER_ASSETS
exec .venv/bin/impvm dev up "$@"
