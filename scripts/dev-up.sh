#!/usr/bin/env bash
# The embedded stack: set up what it runs (scripts/setup.sh stack) and run `impvm dev up`.
# Extra arguments go to `impvm dev up` (e.g. --jobs 3 --until-done).
set -euo pipefail
cd "$(dirname "$0")/.."
KUBEBUILDER_ASSETS="$(bash scripts/setup.sh stack)"
export KUBEBUILDER_ASSETS
exec .venv/bin/impvm dev up "$@"
