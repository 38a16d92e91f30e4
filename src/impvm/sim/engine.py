"""The discrete-event loop: one policy, one trace, one model, one seeded run.

Events, in time order (ties in the order they were scheduled):

- a job is queued (from the trace): if its labels match the pool it joins GitHub's queue and
  the pool is woken (a webhook delivery);
- a VM's runner comes online (``model.boot`` after the policy created it);
- GitHub starts a job on a runner (``model.assign`` after a queued job and an idle runner were
  paired: the oldest queued job with the runner idle longest);
- a job completes (its trace duration after it started): the VM is finished;
- a pass: ``model.reaction`` after the first event that woke the pool (a job queued, a runner
  online, a job started or completed, and the pool's own VM creations and deletions, which come
  back to the controller as watch events), or ``policy.tick_seconds`` after the previous pass
  when nothing woke it (the operator's resync: its pool daemon waits for a wake-up or that
  delay). A policy whose ``tick_mode`` is ``loop`` also passes on a fixed ``tick_seconds`` grid
  (GARM's timer loops). One pass serves every wake-up before it.

A pass hands the policy a :class:`~impvm.sim.world.PoolView` and carries out its
:class:`~impvm.sim.world.Actions` at once. The run ends when every matching job completed, or
``horizon`` seconds after the last job was queued (the jobs still waiting then are reported as
unserved).

Measured: each job's wait (queued to started on a runner), idle runner-seconds (runners online
without a job, which is what warm capacity costs), VM-seconds (every VM from creation to
deletion), the peak number of VMs at once, and the same per time bin for plots.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import IntEnum

from impvm.scaling.labels import job_matches
from impvm.sim.machine import Machine
from impvm.sim.model import Model
from impvm.sim.trace import TraceJob
from impvm.sim.world import PREFIX, Actions, Policy, PoolView

__all__ = ["DEFAULT_BIN_SECONDS", "DEFAULT_HORIZON_SECONDS", "RunResult", "simulate"]

DEFAULT_BIN_SECONDS = 600.0
DEFAULT_HORIZON_SECONDS = 6 * 3600.0


class _Ev(IntEnum):
    ARRIVE = 0
    READY = 1
    START = 2
    DONE = 3
    PASS = 4
    TICK = 5


@dataclass(slots=True)
class RunResult:
    """One run's measurements (seconds; ``start`` is simulation time 0).

    - ``waits``/``queued_at``: per served job, its wait and queued time (same order).
    - ``unserved``: matching jobs never started before the run ended; ``censored``: their
      waits until then (lower bounds); ``unmatched``: trace jobs whose labels the pool does not
      serve (ignored).
    - ``idle_seconds``, ``vm_seconds``, ``peak_vms``, ``vms_created``, ``passes``.
    - ``bin_seconds`` and per bin: ``idle_by_bin``, ``vms_by_bin`` (runner-seconds).
    - ``end``: when the run ended.
    """

    policy: str
    label: str
    start: datetime
    bin_seconds: float
    waits: list[float] = field(default_factory=list)
    queued_at: list[float] = field(default_factory=list)
    unserved: int = 0
    censored: list[float] = field(default_factory=list)
    unmatched: int = 0
    idle_seconds: float = 0.0
    vm_seconds: float = 0.0
    peak_vms: int = 0
    vms_created: int = 0
    passes: int = 0
    end: float = 0.0
    idle_by_bin: list[float] = field(default_factory=list)
    vms_by_bin: list[float] = field(default_factory=list)


class _Run:
    def __init__(
        self,
        trace: Sequence[TraceJob],
        policy: Policy,
        model: Model,
        pool_labels: Sequence[str],
        start: datetime,
        horizon: float,
        bin_seconds: float,
    ) -> None:
        self.trace = trace
        self.policy = policy
        self.model = model
        self.labels = tuple(pool_labels)
        self.start = start
        self.horizon = horizon
        # two streams, so the number of VMs one policy makes does not shift its assignment draws
        self.boot_rng = random.Random(f"{model.seed}-boot")
        self.assign_rng = random.Random(f"{model.seed}-assign")
        self.res = RunResult(policy.name, policy.label, start, bin_seconds)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.vms: dict[str, Machine] = {}
        self.by_id: dict[int, Machine] = {}
        self.next_id = 1
        self.waiting: list[tuple[float, int]] = []  # (queued, job): no runner yet
        self.reserved: dict[int, tuple[Machine, int]] = {}  # job -> (runner, token)
        self.tokens = 0
        self.idle_since: dict[str, float] = {}  # idle runners not reserved -> since
        self.pass_pending = False
        self.epoch = 0  # passes so far; a PASS or TICK scheduled in an earlier epoch is stale
        self.loop = policy.tick_mode == "loop"
        self.matched = 0
        self.completed_total = 0
        self.idle_count = 0
        # since the previous pass
        self.arrivals: list[float] = []
        self.ready: list[tuple[float, float]] = []
        self.started: list[tuple[int, str]] = []
        self.completed = 0

    # -- bookkeeping ---------------------------------------------------------------------

    def push(self, t: float, ev: _Ev, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, int(ev), a, b))

    def advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            idle, vms = self.idle_count, len(self.vms)
            self.res.idle_seconds += idle * dt
            self.res.vm_seconds += vms * dt
            w = self.res.bin_seconds
            t0 = self.now
            while t0 < t:
                i = int(t0 // w)
                t1 = min(t, (i + 1) * w)
                while len(self.res.idle_by_bin) <= i:
                    self.res.idle_by_bin.append(0.0)
                    self.res.vms_by_bin.append(0.0)
                self.res.idle_by_bin[i] += idle * (t1 - t0)
                self.res.vms_by_bin[i] += vms * (t1 - t0)
                t0 = t1
        self.now = t

    def wake(self) -> None:
        if not self.pass_pending:
            self.pass_pending = True
            self.push(self.now + self.model.reaction, _Ev.PASS, self.epoch)

    def at(self, t: float) -> datetime:
        return self.start + timedelta(seconds=t)

    # -- GitHub's side ---------------------------------------------------------------------

    def assign(self) -> None:
        """Pair the oldest queued jobs with the runners idle longest."""
        while self.waiting and self.idle_since:
            _, job = self.waiting.pop(0)
            name = min(self.idle_since, key=lambda n: (self.idle_since[n], n))
            del self.idle_since[name]
            vm = self.vms[name]
            vm.job = job
            self.tokens += 1
            self.reserved[job] = (vm, self.tokens)
            self.push(
                self.now + self.model.assign.sample(self.assign_rng), _Ev.START, job, self.tokens
            )

    # -- events ----------------------------------------------------------------------------

    def on_arrive(self, job: int) -> None:
        if not job_matches(self.trace[job].labels, self.labels):
            self.res.unmatched += 1
            return
        self.matched += 1
        bisect.insort(self.waiting, (self.now, job))
        self.arrivals.append(self.now)
        self.assign()
        self.wake()

    def on_ready(self, runner_id: int) -> None:
        vm = self.by_id.get(runner_id)
        if vm is None or vm.online is not None:
            return  # deleted while booting
        vm.online = self.now
        vm.changed()
        self.idle_count += 1
        self.idle_since[vm.name] = self.now
        self.ready.append((self.now, self.now - vm.created))
        self.assign()
        self.wake()

    def on_start(self, job: int, token: int) -> None:
        held = self.reserved.get(job)
        if held is None or held[1] != token:
            return  # its runner was deleted meanwhile; the job was queued again
        vm = held[0]
        del self.reserved[job]
        vm.started = True
        vm.changed()
        self.idle_count -= 1
        queued = self.trace[job].queued_at
        q = (queued - self.start).total_seconds()
        self.res.waits.append(self.now - q)
        self.res.queued_at.append(q)
        self.started.append((job, vm.name))
        self.push(self.now + self.trace[job].duration_seconds, _Ev.DONE, vm.runner_id)
        self.wake()

    def on_done(self, runner_id: int) -> None:
        vm = self.by_id[runner_id]
        vm.done = True
        vm.changed()
        self.completed += 1
        self.completed_total += 1
        self.wake()

    # -- the controller --------------------------------------------------------------------

    def run_pass(self) -> None:
        self.res.passes += 1
        self.epoch += 1
        self.pass_pending = False
        queued_jobs = sorted(
            [(job, q) for q, job in self.waiting]
            + [(job, self._queued(job)) for job in self.reserved],
            key=lambda p: (p[1], p[0]),
        )
        view = PoolView(
            now=self.now,
            clock=self.at(self.now),
            vms=tuple(m.vm() for m in self.vms.values()),
            queued=len(queued_jobs),
            queued_jobs=tuple(queued_jobs),
            arrivals=tuple(self.arrivals),
            ready=tuple(self.ready),
            started=tuple(self.started),
            completed=self.completed,
        )
        self.arrivals, self.ready, self.started, self.completed = [], [], [], 0
        if self.apply(self.policy.plan(view)):
            self.wake()
        if not self.loop:
            self.push(self.now + self.policy.tick_seconds, _Ev.TICK, self.epoch)

    def _queued(self, job: int) -> float:
        return (self.trace[job].queued_at - self.start).total_seconds()

    def apply(self, actions: Actions) -> bool:
        """Carry out ``actions``; True when a VM was created or deleted."""
        changed = False
        for name, patch in actions.records:
            machine = self.vms.get(name)
            if machine is not None:
                for k, v in patch.items():
                    old = machine.recorded.get(k)
                    merged = {**old, **v} if isinstance(old, dict) and isinstance(v, dict) else v
                    machine.recorded[k] = merged
                machine.changed()
        for name in actions.delete:
            vm = self.vms.pop(name, None)
            if vm is None:
                continue
            if vm.busy:
                raise RuntimeError(f"policy {self.policy.name} deleted busy VM {name}")
            changed = True
            del self.by_id[vm.runner_id]
            if vm.idle:
                self.idle_count -= 1
            self.idle_since.pop(name, None)
            if vm.job is not None and not vm.started:  # being assigned: GitHub queues it again
                del self.reserved[vm.job]
                bisect.insort(self.waiting, (self._queued(vm.job), vm.job))
        for i in range(actions.create):
            n = self.next_id
            self.next_id += 1
            trigger = actions.triggers[i] if i < len(actions.triggers) else None
            vm = Machine(
                name=f"{PREFIX}{n:06x}",
                runner_id=n,
                created=self.now,
                created_at=self.at(self.now),
                trigger_job=trigger,
            )
            self.vms[vm.name] = vm
            self.by_id[n] = vm
            self.res.vms_created += 1
            self.push(self.now + self.model.boot.sample(self.boot_rng), _Ev.READY, n)
        self.res.peak_vms = max(self.res.peak_vms, len(self.vms))
        self.assign()
        return changed or actions.create > 0

    def run(self) -> RunResult:
        for i, job in enumerate(self.trace):
            self.push((job.queued_at - self.start).total_seconds(), _Ev.ARRIVE, i)
        last = (self.trace[-1].queued_at - self.start).total_seconds() if self.trace else 0.0
        self.push(0.0, _Ev.TICK, self.epoch)
        handlers: dict[int, Callable[[int, int], None]] = {
            _Ev.ARRIVE: lambda a, b: self.on_arrive(a),
            _Ev.READY: lambda a, b: self.on_ready(a),
            _Ev.START: self.on_start,
            _Ev.DONE: lambda a, b: self.on_done(a),
        }
        while self.heap:
            t, _, ev, a, b = heapq.heappop(self.heap)
            if t > last + self.horizon:
                break
            self.advance(t)
            if ev == _Ev.PASS:
                if a == self.epoch:
                    self.run_pass()
            elif ev == _Ev.TICK:
                if self.loop:
                    self.run_pass()
                    self.push(t + self.policy.tick_seconds, _Ev.TICK)
                elif a == self.epoch:
                    self.run_pass()
            else:
                handlers[ev](a, b)
            if self.completed_total == self.matched and t >= last:
                break
        self.res.end = self.now
        waiting = [q for q, _ in self.waiting] + [self._queued(j) for j in self.reserved]
        self.res.censored = sorted(max(0.0, self.now - q) for q in waiting)
        self.res.unserved = len(self.res.censored)
        return self.res


def simulate(
    trace: Sequence[TraceJob],
    policy: Policy,
    model: Model,
    pool_labels: Sequence[str],
    *,
    start: datetime | None = None,
    horizon: float = DEFAULT_HORIZON_SECONDS,
    bin_seconds: float = DEFAULT_BIN_SECONDS,
) -> RunResult:
    """Replay ``trace`` (sorted by queued time) through ``policy`` in ``model``'s world.

    ``pool_labels``: the pool's ``spec.labels`` (jobs whose labels do not match are ignored,
    as :func:`impvm.scaling.labels.job_matches` decides); ``start``: simulation time 0 (default:
    the first job's queued time). Deterministic: the same arguments give the same result.
    Raises RuntimeError if the policy deletes a busy VM.
    """
    if start is None:
        if not trace:
            raise ValueError("an empty trace needs a start")
        start = trace[0].queued_at
    return _Run(trace, policy, model, pool_labels, start, horizon, bin_seconds).run()
