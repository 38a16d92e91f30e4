"""The metric families the operator and the agent export: every ``impvm_`` collector in the
default registry once both processes' modules are imported."""

from __future__ import annotations

from prometheus_client import REGISTRY

import impvm.agent.main
import impvm.operator.main


def exported_families() -> dict[str, str]:
    """Family name (counters with ``_total``) -> type (counter, gauge, histogram, ...)."""
    assert impvm.agent.main and impvm.operator.main  # imported for their collectors
    out: dict[str, str] = {}
    for fam in REGISTRY.collect():
        if not fam.name.startswith("impvm_"):
            continue
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = fam.type
    return out


def family_labels() -> dict[str, set[str]]:
    """Family name (as :func:`exported_families`) -> its label names."""
    out: dict[str, set[str]] = {}
    for collector in list(REGISTRY._collector_to_names):  # the registry keeps no public list
        describe = getattr(collector, "_labelnames", None)
        name = getattr(collector, "_name", None)
        kind = getattr(collector, "_type", None)
        if not isinstance(name, str) or not name.startswith("impvm_") or describe is None:
            continue
        key = name + "_total" if kind == "counter" else name
        out[key] = set(describe)
    return out
