"""What a reaper pass reports: each VM's :class:`ReapOutcome` and the pass's
:class:`ReapReport` (what the ``Reaper`` condition and the logs say). Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field

from impvm.reaper.table import ReapVerdict

__all__ = ["ReapOutcome", "ReapReport"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReapOutcome:
    """What a pass did with one VM: ``verdict`` (action, table rule, reason sentence), the
    recorded ``run_id``/``repository``/``runner_id`` (None when not recorded), and for a
    deleted VM the deregistration outcome (``deleted``, ``busy``, ``not_found``, ``failed``;
    None when not attempted)."""

    vm: str
    verdict: ReapVerdict
    run_id: int | None = None
    repository: str | None = None
    runner_id: int | None = None
    deregistration: str | None = None


@dataclass(slots=True, kw_only=True)
class ReapReport:
    """Result of one pass over pool ``namespace/pool``.

    - ``deleted``: VMs deleted; ``would_delete``: VMs a dry run would have deleted;
    - ``kept``: VMs judged to stay (idle, running within the bound, inside the grace, deleting);
    - ``unjudged``: VMs left alone because their record is malformed or GitHub could not be
      read for them (``not_judged`` is their count);
    - ``failed``: VMs judged ``delete`` whose deletion the API server refused;
    - ``error`` / ``error_reason``: why the pass as a whole did nothing (token not minted, VMs
      not listable, credentials unreadable); None when it ran;
    - ``skipped``: the pool's reaper is not enabled (nothing was read or written).
    """

    namespace: str
    pool: str
    dry_run: bool = False
    deleted: list[ReapOutcome] = field(default_factory=list)
    would_delete: list[ReapOutcome] = field(default_factory=list)
    kept: list[ReapOutcome] = field(default_factory=list)
    unjudged: list[ReapOutcome] = field(default_factory=list)
    failed: list[ReapOutcome] = field(default_factory=list)
    error: str | None = None
    error_reason: str | None = None
    skipped: bool = False

    @property
    def not_judged(self) -> int:
        """How many VMs were not judged."""
        return len(self.unjudged)

    @property
    def complete(self) -> bool:
        """Whether every VM was judged and every decision carried out."""
        return self.error is None and not self.unjudged and not self.failed

    def summary(self) -> str:
        """One sentence for the condition message and logs (no secrets)."""
        if self.error is not None:
            return self.error
        parts = [
            f"deleted {len(self.deleted)}",
            f"kept {len(self.kept)}",
            f"not judged {self.not_judged}",
        ]
        if self.dry_run:
            parts.insert(1, f"would delete {len(self.would_delete)} (dry run)")
        if self.failed:
            parts.append(f"deletion failed {len(self.failed)}")
        text = "last pass: " + ", ".join(parts)
        if self.unjudged:
            text += "; " + "; ".join(o.verdict.reason for o in self.unjudged[:3])
        if self.failed:
            text += "; " + "; ".join(o.verdict.reason for o in self.failed[:3])
        return text
