"""Pure capacity accounting for the node agent: does one more VM fit on this node?"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resources:
    """vCPUs and memory (MiB)."""

    vcpu: int
    memory_mib: int

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.vcpu + other.vcpu, self.memory_mib + other.memory_mib)


ZERO = Resources(0, 0)


def fits(capacity: Resources, used: Resources, request: Resources) -> bool:
    """True when ``request`` fits into ``capacity`` next to ``used`` (both dimensions)."""
    return (
        used.vcpu + request.vcpu <= capacity.vcpu
        and used.memory_mib + request.memory_mib <= capacity.memory_mib
    )


def total(items: list[Resources]) -> Resources:
    """Sum of resources."""
    out = ZERO
    for r in items:
        out = out + r
    return out
