"""What the operator and the agent both export: the `/metrics` and `/healthz` endpoint and the
VM phase-transition counter."""
