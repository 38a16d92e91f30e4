"""Per-pool job timings over the last hour, from the timing fields the agent and the operator
write on each ImpVM (``status.timings``). Pure.

Three durations per VM, each taken once (keyed by the VM's name, so a VM seen again in every
pass is counted once):

- ``jobPickup``: ``jobQueuedAt`` → ``jobStartedAt`` (the job's wait from queued to in progress,
  as impvm saw it: first seen queued, GitHub's ``started_at``);
- ``vmBoot``: ``startedAt`` (the agent started the VM) → ``bootedAt`` (its runner runs);
- ``runnerRegistration``: ``createdAt`` (the ImpVM was created) → ``runnerOnlineAt`` (GitHub
  lists its runner online).

Why VM fields and not Prometheus: ``impvm status`` reads only the Kubernetes API (no Prometheus
needed, any kubeconfig works), and the operator, which sees every VM of a pool pass after pass,
keeps a window of the last hour and publishes its p50/p95 on the pool's ``status.timings``. A VM
is deleted after its job, so the window lives in the operator (a restarted operator starts a
new window from the VMs that exist); the Prometheus histograms
(``impvm_job_pickup_seconds``, ``impvm_vm_boot_seconds``, ``impvm_runner_registration_seconds``)
keep the long history.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from impvm.api.vm import VM

WINDOW_SECONDS = 3600.0
#: samples kept per kind (the oldest go first): bounds memory whatever the job rate
MAX_SAMPLES = 2000
KINDS = ("jobPickup", "vmBoot", "runnerRegistration")


@dataclass(frozen=True, slots=True)
class Sample:
    """One duration (seconds) that ended at ``at``."""

    at: dt.datetime
    seconds: float


@dataclass(frozen=True, slots=True)
class TimingWindow:
    """Samples by kind, then by VM name (a value: :func:`observe` returns a new one), and when
    the oldest of them ended (None: no sample)."""

    samples: Mapping[str, Mapping[str, Sample]] = field(
        default_factory=lambda: {k: {} for k in KINDS}
    )
    oldest: dt.datetime | None = None


def durations(vm: VM) -> dict[str, Sample]:
    """The durations ``vm``'s timing fields give (kinds whose two ends are recorded)."""
    t = vm.status.timings
    out: dict[str, Sample] = {}
    if t is None:
        return out
    pairs = (
        ("jobPickup", t.job_queued_at, t.job_started_at),
        ("vmBoot", vm.status.started_at, t.booted_at),
        ("runnerRegistration", t.created_at, t.runner_online_at),
    )
    for kind, start, end in pairs:
        if start is not None and end is not None:
            out[kind] = Sample(end, max(0.0, (end - start).total_seconds()))
    return out


def observe(window: TimingWindow, vms: Iterable[VM], now: dt.datetime) -> TimingWindow:
    """``window`` with the durations of ``vms`` added and samples older than an hour (or
    beyond :data:`MAX_SAMPLES`) dropped: a new window, or ``window`` itself when nothing
    changed (a pass over the same VMs copies nothing)."""
    horizon = now - dt.timedelta(seconds=WINDOW_SECONDS)
    added: dict[str, dict[str, Sample]] = {}
    for vm in vms:
        for kind, sample in durations(vm).items():
            if sample.at >= horizon and window.samples.get(kind, {}).get(vm.name) != sample:
                added.setdefault(kind, {})[vm.name] = sample
    stale = window.oldest is not None and window.oldest < horizon
    if not added and not stale:
        return window
    samples: dict[str, Mapping[str, Sample]] = {}
    for kind in {*window.samples, *added}:
        by_vm = {**window.samples.get(kind, {}), **added.get(kind, {})}
        fresh = sorted(
            ((n, s) for n, s in by_vm.items() if s.at >= horizon), key=lambda kv: kv[1].at
        )
        samples[kind] = dict(fresh[-MAX_SAMPLES:])
    ends = [s.at for by_vm in samples.values() for s in by_vm.values()]
    return TimingWindow(samples, min(ends) if ends else None)


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank method; raises
    ``ValueError`` when empty."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def summary(window: TimingWindow) -> dict[str, Mapping[str, float | int]]:
    """``{kind: {"count", "p50Seconds", "p95Seconds"}}`` for the kinds with samples (wire
    form of the pool's ``status.timings``)."""
    out: dict[str, Mapping[str, float | int]] = {}
    for kind in KINDS:
        values = [s.seconds for s in window.samples.get(kind, {}).values()]
        if values:
            out[kind] = {
                "count": len(values),
                "p50Seconds": round(quantile(values, 0.5), 3),
                "p95Seconds": round(quantile(values, 0.95), 3),
            }
    return out
