"""The node agent's decisions about one VM, as one pure function: ``next_steps(VMObservation) ->
VMSteps``. No I/O: the agent shell (:mod:`impvm.agent.agent`) observes (watch caches, the
runtime, what it did itself), calls :func:`next_steps`, carries out the steps in order and
decides again; a step that fails leaves the rest undone and the next decision starts from what is
observed then (level-triggered, like a Kubernetes controller).

The ladder, first match wins (each rung names its :class:`Why`):

1. the VM is gone: stop and clean up what this agent still runs for it;
2. unbound, or bound to another node: nothing to do (the operator places VMs,
   :mod:`impvm.scaling.placement`; the API server refuses an agent any write to a VM not
   bound to its node);
3. being deleted, or finished (Succeeded/Failed): stop, clean up, and only then release the
   finalizer (never before the runtime reported the VM stopped and its files are removed);
4. bound here without the finalizer: admit it, as the kubelet admits a pod: refuse a VM whose
   ImpVMClass is missing (condition ``ClassMissing`` naming the class, and an Event); fail it
   while the host preflight fails (``NodePreflightFailed``) or when it does not fit the
   node's free capacity (``OutOfCapacity``); else add the finalizer (from then on it holds
   capacity here);
5. not started (no phase, Pending, Scheduled): report Scheduled, prepare the image (pull by
   digest, verify, check signatures when the VM requires them, unpack), wait for the JIT
   config Secret, start;
6. started (Starting, Running): report Running; finish with the runner's exit (Succeeded on 0);
   fail on the ``expireAfter`` deadline (DeadlineExceeded), on a start that takes longer than
   the start timeout (StartTimeout), or when the runtime no longer knows the VM (Lost).

After an agent restart nothing of :class:`LocalFacts` is left, and none is needed: a runtime whose
VMs outlive the agent process (``qemu``) re-attaches a VM it finds running when first asked about
it, so the runtime reports ``starting``/``running`` and rung 6 carries on watching it (no second
:class:`Start`, so no second JIT config; a VM still in a not-started phase is reported started by
rung 5), or ``exited`` with the exit code the VM reported while no agent ran, which rung 6 reports
as for any exit. Only a VM the runtime cannot re-attach (``missing``: the ``process`` runtime's
sandboxes die with the agent) is Lost.

The VM's own network (:mod:`impvm.agent.network`) sits at the two ends of the runtime's run: the
runtime attaches it inside :class:`Start` just before the launch and detaches it inside
:class:`Cleanup` just after the stop (:class:`~impvm.agent.runtime_base.RuntimeBase`), so a failed
attach is a StartFailed like any other and every path that cleans a VM up removes its network.

Where later capabilities slot in, without reshaping: a failing host preflight already gates
admission (:class:`Preflight`); signature verification is part of :class:`Prepare`
(a refusal arrives as :attr:`LocalFacts.failure`, every outcome as
:attr:`LocalFacts.verification`, reported in the ``ImageVerified`` condition); keeping the
console of a failed VM is an option of :class:`Cleanup` chosen in :func:`_fail`/:func:`_finish`.
"""

from impvm.agent.lifecycle.ladder import next_steps
from impvm.agent.lifecycle.observation import (
    NOT_STARTED,
    LocalFacts,
    Policy,
    Preflight,
    VMObservation,
)
from impvm.agent.lifecycle.reports import (
    CLASS_MISSING,
    CONSOLE_TAIL_LINES,
    EVENT_CHARS,
    IMAGE_VERIFIED,
    MESSAGE_CHARS,
    console_tail,
)
from impvm.agent.lifecycle.steps import (
    AddFinalizer,
    Cleanup,
    Emit,
    KeepConsole,
    PatchStatus,
    Prepare,
    Release,
    Start,
    Step,
    Stop,
    VMSteps,
    Why,
)

__all__ = [
    "CLASS_MISSING",
    "CONSOLE_TAIL_LINES",
    "EVENT_CHARS",
    "IMAGE_VERIFIED",
    "MESSAGE_CHARS",
    "NOT_STARTED",
    "AddFinalizer",
    "Cleanup",
    "Emit",
    "KeepConsole",
    "LocalFacts",
    "PatchStatus",
    "Policy",
    "Preflight",
    "Prepare",
    "Release",
    "Start",
    "Step",
    "Stop",
    "VMObservation",
    "VMSteps",
    "Why",
    "console_tail",
    "next_steps",
]
