"""Pure decisions about VMs bound to nodes whose agent is gone (like Kubernetes' node lifecycle
controller for pods): an agent renews its Lease every few seconds; when a Lease has not been
renewed for ``lease duration + grace``, its node is lost and its VMs can never progress."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass

#: Lease annotations the agent writes (docs/architecture.md, agent Leases)
VCPU, MEMORY_MIB = "imp.dev/vcpu", "imp.dev/memory-mib"
VCPU_USED, MEMORY_MIB_USED = "imp.dev/vcpu-used", "imp.dev/memory-mib-used"
#: ``ok`` or ``failed: <check>...`` (``impvm doctor``'s host checks, run at agent start)
PREFLIGHT = "imp.dev/preflight"
#: the QEMU accelerator the agent runs VMs with: ``kvm``, ``tcg`` (emulation), ``none``
ACCELERATOR = "imp.dev/accelerator"
#: The longest Lease duration believed (s): a node's Lease claiming more is judged by this, so
#: a node cannot stay alive for years on one renewal (the agent's default is 40 s).
MAX_LEASE_SECONDS = 300
#: How far in the future a renewal may lie (s, clock skew between node and operator): one
#: further ahead is not believed, so a node cannot stay alive by dating its renewal forward.
MAX_CLOCK_SKEW_SECONDS = 60


def _int(annotations: Mapping[str, str], key: str) -> int | None:
    try:
        return int(annotations[key])
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class NodeLease:
    """An agent's Lease: holder (node name), last renewal and duration (seconds), and the
    capacity it advertises: offered and used vCPU and MiB (None: not advertised), and whether
    its host checks passed (an agent whose checks failed runs no VM; no annotation: passed)."""

    node: str
    renewed_at: dt.datetime | None
    duration_seconds: int
    vcpu: int | None = None
    memory_mib: int | None = None
    vcpu_used: int | None = None
    memory_mib_used: int | None = None
    preflight_ok: bool = True
    #: ``imp.dev/accelerator`` as the agent wrote it: ``<kvm|tcg>/<machine>`` for QEMU
    #: (``tcg/microvm``), ``none`` for the process runtime, empty when not written
    accelerator: str = ""

    @classmethod
    def parse(
        cls,
        node: str,
        renewed_at: dt.datetime | None,
        duration_seconds: int,
        annotations: Mapping[str, str],
    ) -> NodeLease:
        """A Lease with the capacity its annotations advertise (malformed values: unknown)."""
        return cls(
            node,
            renewed_at,
            duration_seconds,
            _int(annotations, VCPU),
            _int(annotations, MEMORY_MIB),
            _int(annotations, VCPU_USED),
            _int(annotations, MEMORY_MIB_USED),
            not annotations.get(PREFLIGHT, "ok").startswith("failed"),
            annotations.get(ACCELERATOR, "")[:200],
        )

    def age(self, now: dt.datetime) -> float | None:
        """Seconds since its renewal; None when never renewed or renewed further in the
        future than :data:`MAX_CLOCK_SKEW_SECONDS` (not believed)."""
        if self.renewed_at is None:
            return None
        age = (now - self.renewed_at).total_seconds()
        return None if age < -MAX_CLOCK_SKEW_SECONDS else age

    @property
    def duration(self) -> int:
        """Its duration, at most :data:`MAX_LEASE_SECONDS`."""
        return min(self.duration_seconds, MAX_LEASE_SECONDS)

    def live(self, now: dt.datetime) -> bool:
        """Renewed within its duration (both as believed: see :meth:`age`, :attr:`duration`)."""
        age = self.age(now)
        return age is not None and age <= self.duration

    def offers(self, now: dt.datetime) -> bool:
        """Whether VMs may be placed on its node: live, host checks passed, capacity
        advertised (:mod:`impvm.scaling.placement` places only there)."""
        return self.live(now) and self.preflight_ok and self.free() is not None

    @property
    def emulated(self) -> bool | None:
        """Whether its QEMU runs VMs under TCG emulation (None: no QEMU accelerator reported)."""
        kind = self.accelerator.split("/", 1)[0]
        return {"tcg": True, "kvm": False}.get(kind)

    def free(self) -> tuple[int, int] | None:
        """Free (vCPU, MiB), or None when the Lease does not say."""
        if self.vcpu is None or self.memory_mib is None:
            return None
        return self.vcpu - (self.vcpu_used or 0), self.memory_mib - (self.memory_mib_used or 0)


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """VMs that fit on no node: how many wait, what each needs, and the message saying so."""

    reason: str  # NoAgents or InsufficientCapacity
    waiting: int
    message: str


def unschedulable(
    leases: list[NodeLease], now: dt.datetime, waiting: int, vcpu: int, memory_mib: int
) -> Unschedulable | None:
    """Whether ``waiting`` unbound VMs, each needing ``vcpu`` vCPU and ``memory_mib`` MiB, can
    be placed on no node (like the scheduler's ``FailedScheduling`` for pods, which names the
    free and requested resources). Only nodes the placement uses count (:meth:`NodeLease.offers`:
    live, host checks passed, capacity advertised); free capacity is what their Leases say. None
    when nothing waits or some such node has room. Pure."""
    if waiting <= 0:
        return None
    need = f"{waiting} VM(s) wait for a node: each needs {vcpu} vCPU, {memory_mib} MiB"
    live = sorted((le for le in leases if le.live(now)), key=lambda le: le.node)
    if not live:
        return Unschedulable("NoAgents", waiting, f"{need}; no agent is running")
    offering = [le for le in live if le.offers(now)]
    if not offering:
        names = ", ".join(le.node for le in live)[:400]
        text = f"{need}; no agent offers room ({names}: host checks failed or no capacity)"
        return Unschedulable("NoAgents", waiting, text)
    frees: list[str] = []
    for le in offering:
        free = le.free()
        assert free is not None  # offers() checked it
        if free[0] >= vcpu and free[1] >= memory_mib:
            return None
        frees.append(f"{le.node} {free[0]}/{le.vcpu} vCPU, {free[1]}/{le.memory_mib} MiB free")
    return Unschedulable("InsufficientCapacity", waiting, f"{need}; " + "; ".join(frees)[:800])


def lost_nodes(leases: list[NodeLease], now: dt.datetime, grace_seconds: float) -> set[str]:
    """Nodes whose every Lease expired more than ``grace_seconds`` ago (never renewed counts as
    expired; the grace is the operator's ``node_lost_grace_seconds``, stated once in
    :class:`impvm.scaling.settings.OperatorTunables`). A node may have Leases in several
    namespaces (an agent restarted with another ``--lease-namespace``): one live Lease keeps
    it."""
    expired: dict[str, bool] = {}
    for lease in leases:
        age = lease.age(now)  # None: never renewed, or dated beyond the clock skew
        dead = age is None or age > lease.duration + grace_seconds
        expired[lease.node] = expired.get(lease.node, True) and dead
    return {node for node, dead in expired.items() if dead}


def node_lost(node: str | None, known: set[str], lost: set[str]) -> bool:
    """Whether a VM bound to ``node`` sits on a lost node: its Lease expired, or there is no
    Lease at all for it (the agent never existed or its Lease was deleted)."""
    return bool(node) and (node in lost or node not in known)
