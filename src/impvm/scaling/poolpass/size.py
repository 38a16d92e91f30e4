"""``size_pool(SizingFacts) -> Sizing``: pool sizing and two-way reconciliation with GitHub,
one pure decision per pass (the terms are in :mod:`~impvm.scaling.poolpass.sizing`).

Rules and their sources:

* Pool sizing: terminal VMs (``Succeeded``/``Failed``) are deleted, each runner being
  single-use; ``desired = min(maxConcurrent, busy + pending + minIdle)`` with
  ``pending = max(queued matching jobs, imp.dev/runner-demand)``; at most ``scaleUpStep`` VMs are
  created per pass; never more than ``maxConcurrent`` VMs exist at once (VMs being deleted still
  hold resources and count); surplus idle runners are removed only once ``cooldownSeconds`` have
  passed since the last scale-up (:mod:`~impvm.scaling.poolpass.scaledown`); a scale-down never
  deletes a busy runner; with ``minIdle`` 0 and no demand the pool scales to zero.
* Busy is what any witness says: a job recorded on the VM, GitHub's runner list, or a job
  record (webhook or poll) naming its runner in progress. A runner whose job record says the
  job completed is done: neither supply nor demand (its VM ends once the agent reports it).
  GitHub's runner list lags behind the job's own record: a short job can be taken, run and
  finished between two lists (ARC counts a runner busy from the job's assignment, not from
  the runner list).
* Two-way reconciliation (GARM-style, touching only this pool's runners,
  :mod:`~impvm.scaling.poolpass.twoway`): a registration with no VM is deleted once offline;
  a VM whose runner has not come online within ``bootstrapTimeoutSeconds`` is deleted together
  with its registration; a running VM whose registration vanished with no job is replaced.
* Idempotent, level-triggered: a VM whose JIT Secret was never written gets one
  (:attr:`Sizing.mint_secrets`), or is replaced by the bootstrap timeout.
* Template roll-out (ARC: a spec-hash change recycles idle runners only): an outdated VM does
  not count as supply, so a replacement is made; an outdated VM that is not busy is deleted,
  at most ``scaleUpStep`` per pass, and an idle one only while at least ``minIdle`` idle
  runners remain; a busy one finishes its job first.

How the caller observes, so the decision is sound: the pool's registrations are listed **before**
its ImpVMs (a JIT registration is made only after its VM exists, so every registration seen then
has its VM and is never mistaken for an orphan); ``runners=None`` when they could not be listed
this pass: the decision then makes no GitHub-based decision at all, and each VM counts as its
recorded ``status.runner`` says. Durations are seconds; every datetime is timezone-aware.
"""

from __future__ import annotations

from impvm.api.vm import VM
from impvm.scaling.poolpass import scaledown, twoway
from impvm.scaling.poolpass.sizing import (
    Counts,
    Inventory,
    SecretMint,
    Sizing,
    SizingFacts,
    VMDeletion,
    VMState,
    classify,
    recorded_runner,
)

__all__ = ["size_pool"]


def size_pool(facts: SizingFacts) -> Sizing:
    """Size one pass of a pool (see the module docstring for the rules). Pure, deterministic.

    Deletions decided in this pass do not free capacity until they complete: ``len(facts.vms) +
    create`` never exceeds ``max_concurrent`` (nor does ``create`` exceed ``scale_up_step``).
    No VM classified busy is ever deleted. With ``runners=None`` only terminal VMs are deleted
    and nothing is created, deregistered or minted (each of those needs GitHub)."""
    lim, known = facts.limits, facts.runners is not None
    inv = Inventory.of(facts.runners)
    terminal: list[VMDeletion] = []
    github_based: list[VMDeletion] = []
    mints: list[SecretMint] = []
    observed = dict.fromkeys(VMState, 0)
    kept: list[tuple[VM, VMState]] = []  # live VMs not deleted this pass
    for vm in sorted(facts.vms, key=lambda v: v.name):
        reg = inv.registration(vm) if known else recorded_runner(vm)
        state = classify(vm, reg, vm.name in facts.running, vm.name in facts.finished)
        observed[state] += 1
        if state is VMState.TERMINATING:
            if not vm.deleting and vm.is_terminal:
                terminal.append(twoway.terminal_deletion(vm))
            continue
        if known:
            act = twoway.reconcile_vm(vm, state, reg, inv, facts)
            if isinstance(act, VMDeletion):
                github_based.append(act)
                continue
            if act is not None:
                mints.append(act)
        kept.append((vm, state))
    orphans, notes = twoway.orphans(facts) if known else ([], [])

    # outdated VMs that are not busy are being replaced: they are not supply
    replaced: list[tuple[VM, VMState]] = [
        (vm, s) for vm, s in kept if vm.name in facts.outdated and s is not VMState.BUSY
    ]
    going = {vm.name for vm, _ in replaced}
    current = [(vm, s) for vm, s in kept if vm.name not in going]
    busy = sum(1 for _, s in kept if s is VMState.BUSY)
    idle = sum(1 for _, s in current if s is VMState.IDLE)
    starting = sum(1 for _, s in current if s is VMState.STARTING)
    supply = busy + idle + starting
    pending = max(facts.queued_jobs, facts.demand_annotation or 0)
    desired = min(lim.max_concurrent, busy + pending + lim.min_idle)
    annotation = "unset" if facts.demand_annotation is None else facts.demand_annotation
    formula = (
        f"desired {desired} = min(maxConcurrent {lim.max_concurrent}, busy {busy} + pending "
        f"{pending} (queued {facts.queued_jobs}, annotation {annotation}) + minIdle "
        f"{lim.min_idle}); have {supply} live (idle {idle}, starting {starting}, busy {busy})"
    )
    if replaced:
        formula += f" and {len(replaced)} outdated being replaced"
    create, create_reason = _create(facts, supply, desired, formula)
    surplus, more = scaledown.surplus(facts, current, supply, desired, inv)
    rollout, later = scaledown.rollout(facts, kept, replaced, surplus, inv)
    if supply > desired:
        create_reason = f"{formula}; {supply - desired} surplus, nothing to create"
    removed = {d.name for d in (*surplus, *rollout)}
    counts = Counts(
        starting=observed[VMState.STARTING],
        idle=observed[VMState.IDLE],
        busy=observed[VMState.BUSY],
        terminating=observed[VMState.TERMINATING],
        total=len(facts.vms),
        desired=desired,
        pending=pending,
        outdated=sum(1 for vm, _ in kept if vm.name in facts.outdated),
    )
    return Sizing(
        counts=counts,
        create=create,
        create_reason=create_reason,
        delete_vms=(*terminal, *github_based, *surplus, *rollout),
        delete_registrations=tuple(orphans),
        # a VM removed this pass (surplus, outdated) needs no JIT config any more
        mint_secrets=tuple(m for m in mints if m.name not in removed),
        notes=(*notes, *more, *later),
    )


def _create(facts: SizingFacts, supply: int, desired: int, formula: str) -> tuple[int, str]:
    """How many VMs to create, and why (a sentence with the arithmetic)."""
    lim = facts.limits
    if supply > desired:
        return 0, formula
    if supply == desired:
        return 0, f"{formula}; nothing to create"
    need = desired - supply
    headroom = max(0, lim.max_concurrent - len(facts.vms))
    if facts.runners is None:
        why = (
            f"{formula}; {need} short, but creating none: the GitHub runner inventory is "
            "unknown this pass and a new VM needs a JIT config from GitHub"
        )
        return 0, why
    create = min(need, lim.scale_up_step, headroom)
    why = (
        f"{formula}; creating {create} of {need} short (scaleUpStep {lim.scale_up_step}, "
        f"headroom {headroom} = maxConcurrent {lim.max_concurrent} - {len(facts.vms)} VMs "
        "incl. terminating)"
    )
    return create, why
