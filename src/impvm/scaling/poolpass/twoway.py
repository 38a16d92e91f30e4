"""Two-way reconciliation with GitHub, one VM or one registration at a time (GARM: only ever
touch runners this installation created; a VM whose runner never came online within a bootstrap
timeout, a registration without a VM). Pure; :func:`impvm.scaling.poolpass.size.size_pool`
calls these for every VM it keeps."""

from __future__ import annotations

from impvm.api.models import VMPhase
from impvm.api.vm import VM
from impvm.scaling.poolpass.sizing import (
    Inventory,
    Reason,
    RegistrationDeletion,
    SecretMint,
    SizingFacts,
    VMDeletion,
    VMState,
)
from impvm.scaling.poolpass.world import RunnerView

__all__ = ["orphans", "reconcile_vm", "terminal_deletion"]


def terminal_deletion(vm: VM) -> VMDeletion:
    """A terminal VM goes: its runner is single-use (its registration at best)."""
    reason = Reason.SUCCEEDED if vm.phase == VMPhase.SUCCEEDED else Reason.FAILED
    return VMDeletion(
        name=vm.name,
        runner_id=vm.runner_id,
        reason=reason,
        message=f"VM {vm.name} is {vm.phase}; each runner is single-use",
        deregister_first=False,
    )


def reconcile_vm(
    vm: VM, state: VMState, reg: RunnerView | None, inv: Inventory, facts: SizingFacts
) -> VMDeletion | SecretMint | None:
    """What GitHub's registrations say must happen to one live VM: replaced (its registration
    vanished while it runs and no job is known; its runner not online within the bootstrap
    timeout), given a JIT config (it has no Secret), or nothing."""
    if state is not VMState.BUSY and reg is None and vm.runner_id is not None:
        if vm.phase == VMPhase.RUNNING:
            return VMDeletion(
                name=vm.name,
                runner_id=vm.runner_id,
                reason=Reason.REGISTRATION_VANISHED,
                message=f"runner {vm.runner_id} of running VM {vm.name} is no longer "
                "registered on GitHub and has no job; replacing the VM",
                deregister_first=False,
            )
    if state is not VMState.STARTING:
        return None
    since = vm.status.started_at or vm.created_at
    age = (facts.now - since).total_seconds()
    timeout = facts.limits.bootstrap_timeout_seconds
    if age > timeout:
        runner_id = reg.id if reg is not None else vm.runner_id
        what = "started" if vm.status.started_at is not None else "created"
        return VMDeletion(
            name=vm.name,
            runner_id=runner_id,
            reason=Reason.BOOTSTRAP_TIMEOUT,
            message=f"runner of VM {vm.name} not online {int(age)}s after the VM was {what} "
            f"(bootstrap timeout {timeout}s)",
            deregister_first=runner_id is not None,
        )
    if facts.has_secret(vm):
        return None
    # a registration for this VM without its Secret (a pass crashed after the JIT call, or
    # the Secret was deleted) can never be used: replace it
    stale = inv.by_name.get(vm.name)
    return SecretMint(
        name=vm.name,
        stale_runner_id=stale.id if stale is not None else vm.runner_id,
        message=f"VM {vm.name} has no JIT Secret yet",
    )


def orphans(facts: SizingFacts) -> tuple[list[RegistrationDeletion], list[str]]:
    """Registrations this pool made that no VM accounts for: deleted once offline (a busy or
    online one is left alone, with a note)."""
    claimed = {vm.runner_id for vm in facts.vms if vm.runner_id is not None}
    names = {vm.name for vm in facts.vms}
    out: list[RegistrationDeletion] = []
    notes: list[str] = []
    for r in sorted(facts.runners or (), key=lambda r: (r.name, r.id)):
        if r.id in claimed or r.name in names:
            continue
        if r.online or r.busy:
            state = "busy" if r.busy else "online"
            notes.append(
                f"registration {r.name} (id {r.id}) has no VM but is {state}; left alone "
                "until offline"
            )
            continue
        out.append(
            RegistrationDeletion(
                runner_id=r.id,
                name=r.name,
                reason=Reason.ORPHAN_REGISTRATION,
                message=f"registration {r.name} (id {r.id}) is offline and has no VM",
            )
        )
    return out, notes
