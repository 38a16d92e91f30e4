"""What ``impvm simulate`` prints: per policy p50/p95/max wait, idle runner-minutes, VM-minutes
and peak VMs, as a rich table or JSON, and a plot of wait and cost over time.

Percentiles interpolate linearly between order statistics (numpy's default ``linear`` method);
jobs a run never started count with their wait until the run ended.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from impvm.sim.engine import RunResult

__all__ = ["Summary", "percentile", "plot", "summarise", "table"]


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values`` by linear interpolation; 0 when empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    """One policy's figures (waits in seconds, runner time in minutes)."""

    policy: str
    label: str
    jobs: int
    unserved: int
    p50_wait_seconds: float
    p95_wait_seconds: float
    max_wait_seconds: float
    idle_runner_minutes: float
    vm_minutes: float
    peak_vms: int
    vms_created: int

    def wire(self) -> dict[str, Any]:
        """JSON-ready, rounded to 0.1."""
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, float):
                out[k] = round(v, 1)
        return out


def summarise(r: RunResult) -> Summary:
    """The figures of one run."""
    waits = [*r.waits, *r.censored]
    return Summary(
        policy=r.policy,
        label=r.label,
        jobs=len(waits),
        unserved=r.unserved,
        p50_wait_seconds=percentile(waits, 50),
        p95_wait_seconds=percentile(waits, 95),
        max_wait_seconds=max(waits, default=0.0),
        idle_runner_minutes=r.idle_seconds / 60.0,
        vm_minutes=r.vm_seconds / 60.0,
        peak_vms=r.peak_vms,
        vms_created=r.vms_created,
    )


#: (header, Summary attribute, format) of the table's columns
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "label", "{}"),
    ("jobs", "jobs", "{}"),
    ("p50 wait s", "p50_wait_seconds", "{:.1f}"),
    ("p95 wait s", "p95_wait_seconds", "{:.1f}"),
    ("max wait s", "max_wait_seconds", "{:.1f}"),
    ("idle runner-min", "idle_runner_minutes", "{:.0f}"),
    ("VM-min", "vm_minutes", "{:.0f}"),
    ("peak VMs", "peak_vms", "{}"),
)


def table(summaries: Sequence[Summary], title: str) -> Table:
    """A rich table, one row per policy (``unserved`` is shown when a policy left jobs)."""
    t = Table(title=title)
    for header, _, _ in COLUMNS:
        left = header == "policy"
        t.add_column(header, justify="left" if left else "right", no_wrap=left)
    unserved = any(s.unserved for s in summaries)
    if unserved:
        t.add_column("unserved", justify="right")
    for s in summaries:
        cells = [fmt.format(getattr(s, attr)) for _, attr, fmt in COLUMNS]
        if unserved:
            cells.append(str(s.unserved))
        t.add_row(*cells)
    return t


def _bins(r: RunResult) -> tuple[list[float], list[float]]:
    """Per bin: p95 wait of the jobs queued in it (nan if none), mean idle runners."""
    n = len(r.idle_by_bin)
    by_bin: list[list[float]] = [[] for _ in range(n)]
    for q, w in zip(r.queued_at, r.waits, strict=True):
        i = int(q // r.bin_seconds)
        if 0 <= i < n:
            by_bin[i].append(w)
    p95 = [percentile(ws, 95) if ws else math.nan for ws in by_bin]
    idle = [s / r.bin_seconds for s in r.idle_by_bin]
    return p95, idle


def plot(results: Sequence[RunResult], arrivals: Sequence[float], path: Path, title: str) -> None:
    """Draw jobs queued per minute, p95 wait and mean idle runners per time bin, one line per
    policy, into a PNG at ``path`` (matplotlib, Agg backend: no display needed). ``arrivals``:
    the queued times (seconds) of the pool's jobs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        raise ValueError("nothing to plot")
    first = results[0]
    w = first.bin_seconds
    n = max(len(r.idle_by_bin) for r in results)
    midnight = first.start.replace(hour=0, minute=0, second=0, microsecond=0)
    offset = (first.start - midnight).total_seconds()
    xs = [(offset + (i + 0.5) * w) / 3600.0 for i in range(n)]  # hours since midnight
    per_min = [0.0] * n
    for q in arrivals:
        i = int(q // w)
        if 0 <= i < n:
            per_min[i] += 60.0 / w
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True, height_ratios=(1, 2, 2))
    axes[0].fill_between(xs, per_min, step="mid", color="0.6")
    axes[0].set_ylabel("jobs queued / min")
    # distinct dashes too: policies with the same formula draw the same line
    styles = ["-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1))]
    for i, r in enumerate(results):
        p95, idle = _bins(r)
        k = len(idle)
        style = {"drawstyle": "steps-mid", "linestyle": styles[i % len(styles)], "lw": 1.5}
        axes[1].plot(xs[:k], p95, label=r.label, **style)
        axes[2].plot(xs[:k], idle, label=r.label, **style)
    axes[1].set_ylabel(f"p95 wait (s), per {w / 60:g} min")
    axes[1].set_yscale("symlog", linthresh=10)
    axes[2].set_ylabel("idle runners (mean)")
    axes[2].set_xlabel(f"hours since {midnight:%Y-%m-%d} 00:00 {first.start.tzname() or ''}")
    lo, hi = offset / 3600.0, (offset + n * w) / 3600.0
    axes[2].set_xlim(lo, hi)
    step = 1 if hi - lo <= 12 else 2
    axes[2].set_xticks(range(math.floor(lo), math.ceil(hi) + 1, step))
    axes[1].legend(loc="upper left", fontsize="small")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
