#!/usr/bin/env bash
# Build the cosign CLI (github.com/sigstore/cosign/v2) from its Go module into a cache directory,
# once per pinned version, and print the path of the binary. The agent verifies signed images
# with it (cosign verify); tests make key pairs and signatures with it. With
# IMPVM_COSIGN_CHECK_ONLY=1 a missing binary is an error (exit 3) instead of a build.
# A build takes about 400 CPU-seconds and 1.4 GB of memory (plus ~1.7 GB of Go modules).
set -euo pipefail

COSIGN_VERSION="${IMPVM_COSIGN_VERSION:-v2.6.5}"
OUT="${IMPVM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/impvm}/cosign/${COSIGN_VERSION}"

if [[ -x "$OUT/cosign" ]]; then
  echo "$OUT/cosign"
  exit 0
fi
if [[ -n "${IMPVM_COSIGN_CHECK_ONLY:-}" ]]; then
  echo "build-cosign: cosign ${COSIGN_VERSION} is not built in $OUT (run scripts/setup.sh)" >&2
  exit 3
fi
echo "build-cosign: building cosign ${COSIGN_VERSION} (once; cached in $OUT)" >&2
mkdir -p "$OUT"
export CGO_ENABLED=0
GOBIN="$OUT/.tmp" go install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=${COSIGN_VERSION}" \
  "github.com/sigstore/cosign/v2/cmd/cosign@${COSIGN_VERSION}" >&2
mv "$OUT/.tmp/cosign" "$OUT/cosign"
rmdir "$OUT/.tmp"
echo "$OUT/cosign"
