"""Which live VMs a pass removes: surplus idle or starting runners once the cooldown passed, and
outdated VMs of a template roll-out (ARC: a spec-hash change recycles idle runners only). A busy
VM is never chosen. Pure; called by :func:`impvm.scaling.poolpass.size.size_pool`."""

from __future__ import annotations

from collections.abc import Iterable

from impvm.api.vm import VM
from impvm.scaling.poolpass.sizing import Inventory, Reason, SizingFacts, VMDeletion, VMState

__all__ = ["rollout", "surplus"]

Pair = tuple[VM, VMState]


def _surplus_order(pairs: Iterable[Pair]) -> list[Pair]:
    """Removal order of surplus VMs: starting VMs first (no online registration, so no job can
    race onto them), then idle; newest first within each; name (descending) last."""
    by_name = sorted(pairs, key=lambda p: p[0].name, reverse=True)
    return sorted(
        by_name,
        key=lambda p: (0 if p[1] is VMState.STARTING else 1, -p[0].created_at.timestamp()),
    )


def _deregister_then_delete(vm: VM, inv: Inventory, reason: Reason, why: str) -> VMDeletion:
    """A live VM that goes: its registration first (a runner that took a job keeps its VM)."""
    reg = inv.registration(vm)
    runner_id = reg.id if reg is not None else vm.runner_id
    return VMDeletion(
        name=vm.name,
        runner_id=runner_id,
        reason=reason,
        message=why,
        deregister_first=runner_id is not None,
    )


def surplus(
    facts: SizingFacts, current: list[Pair], supply: int, desired: int, inv: Inventory
) -> tuple[list[VMDeletion], list[str]]:
    """The surplus VMs to delete (deregistered first: a runner that took a job meanwhile keeps
    its VM), and notes on surplus kept (cooldown, unknown inventory, busy runners)."""
    lim = facts.limits
    extra = supply - desired
    if extra <= 0:
        return [], []
    if facts.runners is None:
        note = (
            f"{extra} surplus kept: the GitHub runner inventory is unknown, so runners "
            "cannot be deregistered safely this pass"
        )
        return [], [note]
    last = facts.last_scale_up_time
    elapsed = None if last is None else (facts.now - last).total_seconds()
    if elapsed is not None and elapsed < lim.cooldown_seconds:
        note = (
            f"{extra} surplus kept: {int(elapsed)}s since the last scale-up, cooldown "
            f"{lim.cooldown_seconds}s"
        )
        return [], [note]
    ago = "no scale-up recorded" if elapsed is None else f"{int(elapsed)}s since"
    removable = _surplus_order(p for p in current if p[1] in (VMState.IDLE, VMState.STARTING))
    out: list[VMDeletion] = []
    for vm, s in removable[:extra]:
        why = (
            f"{s.value} VM {vm.name} is surplus ({supply} live, desired {desired}; cooldown "
            f"{lim.cooldown_seconds}s elapsed, {ago} the last scale-up)"
        )
        out.append(_deregister_then_delete(vm, inv, Reason.SURPLUS, why))
    notes = []
    if len(removable) < extra:
        notes.append(f"{extra - len(removable)} surplus VMs are busy and are never scaled down")
    return out, notes


def rollout(
    facts: SizingFacts,
    kept: list[Pair],
    replaced: list[Pair],
    surplus: list[VMDeletion],
    inv: Inventory,
) -> tuple[list[VMDeletion], list[str]]:
    """Outdated VMs that go this pass: at most ``scaleUpStep``, busy ones never, an idle one
    only while at least ``minIdle`` idle runners remain (oldest first, starting before idle)."""
    lim = facts.limits
    if not replaced:
        return [], []
    if facts.runners is None:
        note = (
            f"{len(replaced)} outdated VMs kept: the GitHub runner inventory is unknown, so "
            "runners cannot be deregistered safely this pass"
        )
        return [], [note]
    going = {d.name for d in surplus}
    ready = sum(1 for vm, s in kept if s is VMState.IDLE and vm.name not in going)
    oldest_first = sorted(
        replaced, key=lambda p: (p[1] is VMState.IDLE, p[0].created_at.timestamp(), p[0].name)
    )
    out: list[VMDeletion] = []
    waiting = 0
    for vm, s in oldest_first:
        if len(out) >= lim.scale_up_step:
            break
        if s is VMState.IDLE:
            if ready - 1 < lim.min_idle:
                waiting += 1
                continue
            ready -= 1
        why = (
            f"{s.value} VM {vm.name} was made from an older template; replacing it ({ready} "
            f"idle runners stay ready, minIdle {lim.min_idle})"
        )
        out.append(_deregister_then_delete(vm, inv, Reason.OUTDATED, why))
    notes = []
    if waiting:
        notes.append(
            f"{waiting} outdated idle VMs kept until replacements are ready "
            f"(minIdle {lim.min_idle})"
        )
    return out, notes
