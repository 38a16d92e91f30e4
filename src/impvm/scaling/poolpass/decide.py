"""The second phase of a pool pass: ``pool_acts(world) -> PoolActs``, what the pass does, as a
ladder of guards (first match wins, each rung names its :class:`~impvm.scaling.poolpass.acts.
Why`). Pure and deterministic: everything comes from the :class:`~impvm.scaling.poolpass.world.
PoolWorld` (one clock reading, one jitter draw).

1. the template, its class, or the signing key the template requires is missing: nothing
   (``TemplateMissing``; a VM without its key would boot unverified images);
2. the spec is invalid (the sizing or warm-pool fields): nothing but an Event;
3. the acts: lost-node releases and failures; VM deletions, registrations to remove, JIT
   configs to mint and VMs to create (:func:`~impvm.scaling.poolpass.size.size_pool`, with
   ``minIdle`` the warm pool's target); no creation while the template's VMs fail at start
   (:mod:`~impvm.scaling.poolpass.starts`) and none beyond the pool's share of the
   installation's JIT mint budget; GitHub is not called while backing off; the VM records.
"""

from __future__ import annotations

from dataclasses import replace

from impvm.api.models import DEMAND_ANNOTATION, VMPhase
from impvm.api.vm import VM, template_hash
from impvm.scaling.names import owns_runner_name, secret_name
from impvm.scaling.poolpass.acts import (
    DeleteVM,
    EventSpec,
    MintJit,
    PoolActs,
    RemoveRegistration,
    Why,
)
from impvm.scaling.poolpass.lost import lost_vms
from impvm.scaling.poolpass.memory import StartFailures
from impvm.scaling.poolpass.poll import github_usable
from impvm.scaling.poolpass.records import records
from impvm.scaling.poolpass.size import size_pool
from impvm.scaling.poolpass.sizing import PoolLimits, Sizing, SizingFacts, parse_demand
from impvm.scaling.poolpass.starts import next_start, start_failures
from impvm.scaling.poolpass.warm import warm_policy, warm_pool
from impvm.scaling.poolpass.world import PoolWorld

__all__ = ["current_template_hash", "made_from", "pool_acts"]


def current_template_hash(world: PoolWorld) -> str | None:
    """The hash of what a new VM of the pool is made from (None without template or class)."""
    t, c = world.template, world.vm_class
    if t is None or c is None:
        return None
    spec = world.pool.spec
    return template_hash(
        image=t.spec.image,
        runner_layer=spec.runner_layer or t.spec.runner_layer,
        class_name=c.name,
        vcpu=c.spec.vcpu,
        memory_mib=c.spec.memory_mib,
        disk_gib=c.spec.disk_gib,
        expire_after=spec.expire_after or t.spec.expire_after,
        allow_unpinned=bool(spec.allow_unpinned_images or t.spec.allow_unpinned_images),
        network=spec.network.wire() if spec.network is not None else None,
        verify_key=world.verify_key.fingerprint if world.verify_key is not None else None,
    )


def made_from(world: PoolWorld) -> dict[str, str]:
    """Each VM's template hash (:meth:`impvm.api.vm.VM.made_from`, with the pool's class)."""
    c = world.vm_class
    return {vm.name: vm.made_from(c.name if c else None, c.spec if c else None) for vm in world.vms}


def pool_acts(world: PoolWorld) -> PoolActs:
    """Decide one pass of ``world.pool`` (see the module docstring for the ladder)."""
    if not world.found:
        return PoolActs(why=Why.TEMPLATE_MISSING)
    try:
        limits = PoolLimits.from_spec(world.pool.spec)
        policy = warm_policy(world.pool.spec.scaling)
    except ValueError as e:
        return PoolActs(why=Why.INVALID_SPEC, events=(EventSpec("InvalidSpec", str(e), True),))
    events: list[EventSpec] = []
    try:
        demand = parse_demand(world.pool.annotations.get(DEMAND_ANNOTATION))
    except ValueError as e:
        events.append(EventSpec("InvalidDemand", f"{e}; treated as absent", warning=True))
        demand = None
    if world.webhook_secret_missing:
        text = f"Secret {world.webhook_secret_missing!r} not found"
        events.append(EventSpec("WebhookSecretMissing", text, warning=True))
    releases, lost = lost_vms(world)
    failed = {p.name for p in lost}
    digest = current_template_hash(world)
    assert digest is not None
    hashes = made_from(world)
    warm = warm_pool(world, policy)
    runners, prefix = world.github.runners, world.pool.prefix
    finished = {n for n, j in world.finished_jobs.items() if n not in world.running_jobs}
    limits = replace(limits, min_idle=warm[0].target)
    if world.class_denied:  # no VM of a class the namespace may not use; running ones finish
        limits = replace(limits, min_idle=0, max_concurrent=0)
    facts = SizingFacts(
        limits=limits,
        now=world.now,
        # a VM on a lost node is failed in this same pass: counted and replaced as one
        vms=tuple(_as_failed(vm) if vm.name in failed else vm for vm in world.vms),
        runners=None
        if runners is None
        else tuple(r for r in runners if owns_runner_name(prefix, r.name)),
        secrets=world.secrets,
        outdated=frozenset(n for n, h in hashes.items() if h != digest),
        running=frozenset(world.running_jobs),
        finished=frozenset(finished),
        queued_jobs=world.pending_jobs,
        demand_annotation=demand,
        last_scale_up_time=world.pool.status.last_scale_up_time,
    )
    starts = start_failures(world, digest, hashes)
    sizing, held_back = _bounded(world, size_pool(facts), starts)
    acts = _acts(world, sizing)
    return replace(
        acts,
        releases=releases,
        lost=lost,
        made_from=digest,
        events=tuple(events),
        warm=warm,
        starts=starts,
        held_back=held_back,
    )


def _as_failed(vm: VM) -> VM:
    return replace(vm, status=vm.status.model_copy(update={"phase": VMPhase.FAILED}))


def _bounded(world: PoolWorld, sizing: Sizing, starts: StartFailures) -> tuple[Sizing, str]:
    """``sizing`` with no creation while the template's VMs fail at start, and at most the
    pool's JIT mint allowance of mints and creations; and a note saying what was held back."""
    notes: list[str] = []
    create, mints = sizing.create, sizing.mint_secrets
    at = next_start(starts, world)
    if create and at is not None and at > world.now:
        wait = (at - world.now).total_seconds()
        notes.append(f"VMs of this template fail at start; the next is made in {wait:.0f}s")
        create = 0
    allowance = world.github.mint_allowance
    if allowance is not None:
        fresh = [m for m in mints if secret_name(m.name) not in world.secrets]
        kept = {m.name for m in fresh[:allowance]}
        room = max(0, allowance - len(fresh))
        if create > room or len(fresh) > allowance:
            notes.append(
                f"{create - room + max(0, len(fresh) - allowance)} JIT config(s) held back: "
                f"the pool's share of the installation's JIT mint budget allows {allowance} now"
            )
        create = min(create, room)
        mints = tuple(m for m in mints if m.name in kept or secret_name(m.name) in world.secrets)
    if (create, mints) == (sizing.create, sizing.mint_secrets):
        return sizing, "; ".join(notes)
    reason = "; ".join([sizing.create_reason, *notes])
    return replace(sizing, create=create, mint_secrets=mints, create_reason=reason), "; ".join(
        notes
    )


def _acts(world: PoolWorld, sizing: Sizing) -> PoolActs:
    """The sizing as acts: deletions (deregistering first where the sizing says so), orphan
    registrations, mints, creations, VM records; GitHub is called only when it may be."""
    can_call = world.github.connected and not world.github.skipped
    use_github = github_usable(world)
    deletions = tuple(
        DeleteVM(
            name=d.name,
            runner_id=d.runner_id,
            deregister=can_call and d.runner_id is not None,
            deregister_first=d.deregister_first,
            why=d.message,
        )
        for d in sizing.delete_vms
    )
    registrations = tuple(
        RemoveRegistration(
            runner_id=r.runner_id, name=r.name, done=EventSpec("RegistrationRemoved", r.message)
        )
        for r in sizing.delete_registrations
        if can_call
    )
    uids = {vm.name: vm.uid for vm in world.vms}
    mints = tuple(
        MintJit(
            vm=m.name,
            vm_uid=uids[m.name],
            secret=secret_name(m.name),
            stale_runner_id=m.stale_runner_id,
            record_only=secret_name(m.name) in world.secrets,
        )
        for m in sizing.mint_secrets
        if use_github or secret_name(m.name) in world.secrets
    )
    deleted = {d.name for d in deletions}
    return PoolActs(
        sizing=sizing,
        deletions=deletions,
        registrations=registrations,
        mints=mints,
        create=sizing.create if use_github else 0,
        records=records(world, deleted, {m.vm for m in mints if m.record_only}),
        use_github=use_github,
    )
