#!/usr/bin/env bash
# Build impvm's OCI images from Debian packages (cached under ~/.cache/impvm/images by their
# inputs), optionally push them, and print each image's digest. Arguments go to
# `impvm images build` (see docs/images.md), e.g.
#   bash scripts/build-images.sh --push 127.0.0.1:5000 --insecure-registry
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
exec .venv/bin/impvm images build "$@"
