"""Metrics about ImpVMs that the agent and the operator both export (one definition: they can
share a process, as in tests)."""

from __future__ import annotations

from prometheus_client import Counter

PHASE_TRANSITIONS = Counter(
    "impvm_vm_phase_transitions_total",
    "ImpVM phase changes written, by node and the phase entered (the agent reports every phase; "
    "the operator writes Failed for the VMs of a lost node).",
    ["node", "phase"],
)


def record_phase(node: str, old: str | None, new: str | None) -> None:
    """Count a phase change (nothing when ``new`` is empty or equals ``old``)."""
    if new and new != old:
        PHASE_TRANSITIONS.labels(node, new).inc()
