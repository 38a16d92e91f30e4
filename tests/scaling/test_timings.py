"""Pool job timings over the last hour from the VMs' timing fields: each VM counted once,
old samples dropped, nearest-rank quantiles."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st

from impvm.api.models import ImpVMStatus
from impvm.scaling.timings import TimingWindow, observe, quantile, summary
from tests.scaling.builders import NOW, ago, vm


def timed(suffix: str, *, queued: float, started: float, booted_in: float = 0) -> object:
    v = vm(suffix)
    status = ImpVMStatus.model_validate(
        {
            "phase": "Running",
            "startedAt": ago(started + booted_in + 20).isoformat(),
            "timings": {
                "createdAt": ago(started + 60).isoformat(),
                "bootedAt": ago(started + 20).isoformat(),
                "runnerOnlineAt": ago(started + 10).isoformat(),
                "jobQueuedAt": ago(queued).isoformat(),
                "jobStartedAt": ago(started).isoformat(),
            },
        }
    )
    return dataclasses.replace(v, status=status)


def test_each_vm_counts_once_and_old_samples_go() -> None:
    a = timed("aaaaaa", queued=30, started=25, booted_in=4)  # waited 5 s, booted in 4 s
    b = timed("bbbbbb", queued=100, started=90, booted_in=8)
    w = observe(TimingWindow(), [a, b], NOW)  # type: ignore[list-item]
    w = observe(w, [a, b], NOW)  # seen again next pass: still two samples
    got = summary(w)
    assert got["jobPickup"] == {"count": 2, "p50Seconds": 5.0, "p95Seconds": 10.0}
    assert got["vmBoot"] == {"count": 2, "p50Seconds": 4.0, "p95Seconds": 8.0}
    assert got["runnerRegistration"]["count"] == 2
    # an hour later the samples are gone, VMs or not
    later = observe(w, [], NOW + timedelta(hours=1, seconds=100))
    assert summary(later) == {}


def test_vm_without_timings_gives_nothing() -> None:
    assert summary(observe(TimingWindow(), [vm("aaaaaa")], NOW)) == {}


@given(st.lists(st.floats(0, 1e5, allow_nan=False), min_size=1, max_size=50))
def test_quantiles_are_samples_and_ordered(values: list[float]) -> None:
    p50, p95 = quantile(values, 0.5), quantile(values, 0.95)
    assert p50 in values and p95 in values and p50 <= p95 <= max(values)
