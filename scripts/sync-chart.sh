#!/usr/bin/env bash
# Copy the manifests whose source lives in deploy/ to the places that must carry them verbatim:
# the chart (crds/, files/rbac/ from which its RBAC templates take their rules, files/admission/
# from which its admission policies are rendered, and files/grafana/ from which its dashboard
# ConfigMap is made) and the Python package (impvm up applies the RBAC and the admission
# policies from there). tests/chart/test_sync.py fails while a
# copy differs; run this after changing deploy/crds (impvm crds > deploy/crds/imp.dev_crds.yaml)
# or deploy/rbac, deploy/admission or deploy/grafana.
set -euo pipefail
cd "$(dirname "$0")/.."
cp deploy/crds/imp.dev_crds.yaml charts/impvm/crds/imp.dev_crds.yaml
mkdir -p charts/impvm/files/rbac src/impvm/up/assets/rbac
for c in operator agent; do
  cp "deploy/rbac/$c.yaml" "charts/impvm/files/rbac/$c.yaml"
  cp "deploy/rbac/$c.yaml" "src/impvm/up/assets/rbac/$c.yaml"
done
cp deploy/rbac/tenant.yaml charts/impvm/files/rbac/tenant.yaml
mkdir -p charts/impvm/files/admission src/impvm/up/assets/admission
rm -f charts/impvm/files/admission/*.yaml src/impvm/up/assets/admission/*.yaml
for f in deploy/admission/*.yaml; do
  cp "$f" charts/impvm/files/admission/
  cp "$f" src/impvm/up/assets/admission/
done
mkdir -p charts/impvm/files/grafana
cp deploy/grafana/impvm-dashboard.json charts/impvm/files/grafana/impvm-dashboard.json
