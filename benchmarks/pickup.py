"""Benchmark: the user's wait, from a job being queued to GitHub showing it ``in_progress``.

Both ends come from the GitHub stand-in's own job record (``created_at`` when the job was queued,
``started_at`` when a runner took it), on the embedded stack as ``impvm dev up`` ships it (real
control plane, operator and agent processes, the stand-in, the example pool ``ci-pool`` at a 5 s
polling interval, jobs of ``sleep_seconds: 1``), one job at a time:

* ``cold``: no idle runner, the pool at ``minIdle: 0`` (before each job the pool has no VM and
  the stand-in no runner; the job is queued after a random pause of up to ``--spread`` seconds,
  seeded, so it falls anywhere in the operator's poll cycle);
* ``warm``: the pool at ``minIdle: 1`` and an idle runner online at the stand-in before each job.

For each runtime (``process``, ``qemu``), each ``--mode`` (the pool's ``scaling.mode``: ``polling``
as shipped, ``webhook`` or ``hybrid``, for which the stand-in delivers signed ``workflow_job``
webhooks to the operator) and each demand, it prints::

    pickup RUNTIME DEMAND: p50 X s p95 Y s n=N [MODE, TREE]

and, for the cold jobs, where the wait went: a timeline of each job seen from outside the
product (no product code changes it):

* the stand-in's records: the job's queue and start times, its request log (the poll that read
  the job's run, the JIT config minted for the VM), the runners (sampled every 50 ms: when the
  VM's runner went online);
* the benchmark's own watch of the pool's ImpVMs (VM created, JIT Secret named on the VM, bound
  to a node by the operator's placement, each phase the agent reported);
* the VM's status port (``qemu``: the guest init's ``boot`` and ``runner-start`` reports in the
  agent's VM directory, sampled every 50 ms);
* the operator's log (when it handed the JIT config to the agent: the agent's start step);
* the API server's ``apiserver_request_total`` (ImpVM writes answered 409: conflicts);
* the poll cycle (the stand-in's run listings, grouped into polls).

``--tree PATH`` measures the same against another checkout (a git worktree of an older commit
with its own ``.venv``, as ``scripts/setup.sh`` makes it): each configuration runs once with this
checkout and once with PATH's product code (this script, PATH's ``impvm``), back to back, and the
ratios are printed. Each measurement runs in its own process, with a deadline; the stack is
stopped and its directory removed. Loopback and the stack's own namespaces only.

    KUBEBUILDER_ASSETS=$(bash scripts/setup.sh) .venv/bin/python benchmarks/pickup.py \\
        [--runtime process qemu] [--demand cold warm] [--mode polling webhook hybrid] \\
        [--jobs 20] [--tree ../base]

The last lines of each measurement are ``PICKUP {json}`` (for ``benchmarks/run.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNTIMES = ("process", "qemu")
DEMANDS = ("cold", "warm")
MODES = ("polling", "webhook", "hybrid")
LINE_RE = re.compile(
    r"^pickup (\w+) (cold|warm): p50 ([\d.]+) s p95 ([\d.]+) s n=(\d+) \[(\w+), ([^\]]+)\]", re.M
)


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# ---------------------------------------------------------------------- the measurement (child)


@dataclass
class Tracer:
    """When things happened to the pool's VMs and runners (epoch seconds), seen from outside:
    a watch of the ImpVMs, and every 50 ms the stand-in's runners and each VM's status port."""

    stack: Any
    pool: str
    agent_dir: Path
    vm: dict[str, dict[str, float]] = field(default_factory=lambda: collections.defaultdict(dict))
    online: dict[str, float] = field(default_factory=dict)
    uid: dict[str, str] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def mark(self, name: str, what: str, at: float) -> None:
        self.vm[name].setdefault(what, at)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._sample())]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _watch(self) -> None:
        from impvm.api.resources import ImpVMResource
        from impvm.devstack.seed import NAMESPACE

        kube = self.stack.kube
        while True:
            try:
                async for kind, obj in kube.watch(
                    ImpVMResource, namespace=NAMESPACE, labels={"imp.dev/runner-pool": self.pool}
                ):
                    now = time.time()
                    d = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
                    meta, spec = d.get("metadata") or {}, d.get("spec") or {}
                    st = d.get("status") or {}
                    name = meta.get("name", "?")
                    self.mark(name, "seen", now)
                    self.uid[name] = str(meta.get("uid", ""))
                    if spec.get("runnerConfigSecret"):
                        self.mark(name, "secret", now)
                    if spec.get("nodeName"):
                        self.mark(name, "bound", now)
                    if st.get("phase"):
                        self.mark(name, "phase:" + st["phase"], now)
                    if (st.get("runner") or {}).get("id"):
                        self.mark(name, "runner-id", now)
                    if meta.get("deletionTimestamp"):
                        self.mark(name, "deleting", now)
                    if kind == "DELETED":
                        self.mark(name, "gone", now)
            except asyncio.CancelledError:
                raise
            except Exception:  # the watch ended or failed: start another
                await asyncio.sleep(0.2)

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = time.time()
            standin = self.stack.standin
            if standin is not None:
                for r in list(standin.state.runners.values()):
                    if r.status == "online":
                        self.online.setdefault(r.name, now)
            for name, marks in list(self.vm.items()):
                if "runner-start" in marks or "gone" in marks or "bound" not in marks:
                    continue
                uid = self.uid.get(name, "")[:8]
                status = self.agent_dir / "vms" / f"default.{name}.{uid}" / "status.log"
                try:
                    data = status.read_bytes()
                except OSError:
                    continue
                if b"boot" in data:
                    self.mark(name, "guest-init", now)
                if b"runner-start" in data:
                    self.mark(name, "runner-start", now)


def _log_times(path: Path, pattern: re.Pattern[str]) -> dict[str, float]:
    """``{group 1: epoch seconds}`` of the first line matching ``pattern`` per group, from a log
    whose lines start with Python logging's ``%(asctime)s`` (local time, milliseconds)."""
    out: dict[str, float] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = pattern.search(line)
        if m is None or len(line) < 23:
            continue
        try:
            t = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        out.setdefault(m.group(1), t)
    return out


HANDOUT_RE = re.compile(r"JIT config of \S+?/(\S+) handed to the agent")
REQ409_RE = re.compile(
    r'^apiserver_request_total\{(?=[^}]*code="409")(?=[^}]*resource="impvms")'
    r'(?=[^}]*verb="(?:PATCH|UPDATE)")[^}]*\}\s+([\d.e+]+)$',
    re.M,
)


async def impvm_conflicts(s: Any) -> int:
    """ImpVM patches and updates the API server answered 409 so far (its own metrics)."""
    cp = s.control_plane
    proc = await asyncio.create_subprocess_exec(
        str(cp.kubectl),
        "--kubeconfig",
        str(s.kubeconfig),
        "get",
        "--raw",
        "/metrics",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    return int(sum(float(v) for v in REQ409_RE.findall(out.decode(errors="replace"))))


def polls(log: list[dict[str, Any]], t0: float, t1: float) -> list[float]:
    """Start times of the operator's polls between ``t0`` and ``t1``: its run listings
    (``GET /repos/{owner}/{repo}/actions/runs``), grouped by pauses of more than 1 s."""
    times = sorted(
        e["time"]
        for e in log
        if e.get("path") == "/repos/{owner}/{repo}/actions/runs" and t0 <= e["time"] <= t1
    )
    out: list[float] = []
    last = -1e9
    for t in times:
        if t - last > 1.0:
            out.append(t)
        last = t
    return out


#: the cold timeline: (key, label); keys are Tracer marks or the extra points below
TIMELINE = (
    ("queued", "job queued at GitHub"),
    ("poll-read", "a poll read the job's run"),
    ("seen", "VM created"),
    ("jit", "JIT config minted"),
    ("secret", "JIT Secret named on the VM"),
    ("bound", "operator bound the VM to a node"),
    ("phase:Scheduled", "agent reported Scheduled"),
    ("handout", "JIT config handed to the agent (start step)"),
    ("phase:Starting", "agent reported Starting (runtime launched)"),
    ("guest-init", "guest init reported boot (qemu)"),
    ("runner-start", "guest init started the runner (qemu)"),
    ("online", "runner online at GitHub"),
    ("in_progress", "job in progress"),
    ("phase:Running", "agent reported Running"),
)


@dataclass
class Measure:
    """One stack, one runtime and mode; :meth:`run` measures each demand in turn."""

    args: argparse.Namespace
    stack: Any = None
    tracer: Tracer | None = None
    rng: random.Random = field(default_factory=lambda: random.Random(1))

    async def pool_vms(self) -> list[dict[str, Any]]:
        from impvm.devstack.seed import POOL

        return [
            v
            for v in await self.stack.vms()
            if (v["metadata"].get("labels") or {}).get("imp.dev/runner-pool") == POOL
        ]

    async def set_min_idle(self, n: int) -> None:
        from lightkube.types import PatchType

        from impvm.api.resources import ImpVMRunnerPoolResource
        from impvm.devstack.seed import NAMESPACE, POOL

        await self.stack.kube.patch(
            ImpVMRunnerPoolResource,
            POOL,
            {"spec": {"scaling": {"minIdle": n}}},
            namespace=NAMESPACE,
            patch_type=PatchType.MERGE,
        )

    async def wait_cold(self) -> None:
        """No VM in the pool, no runner at the stand-in, no job queued."""
        from impvm.devstack.stack import wait_for

        s = self.stack

        async def cold() -> bool:
            if s.runners() or any(j.status == "queued" for j in s.jobs()):
                return False
            return not await self.pool_vms()

        await wait_for("an empty pool (no VM, no runner)", cold, self.args.timeout, s, 0.5)

    async def wait_warm(self) -> None:
        """A runner of the pool online at the stand-in, not busy, with no job yet."""
        from impvm.devstack.seed import POOL
        from impvm.devstack.stack import wait_for

        s = self.stack

        async def warm() -> bool:
            if any(j.status == "queued" for j in s.jobs()):
                return False
            return any(
                r.name.startswith(POOL) and r.status == "online" and not r.busy and r.job_id is None
                for r in s.runners()
            )

        await wait_for("an idle runner online", warm, self.args.timeout, s, 0.25)

    async def one_job(self, i: int) -> Any:
        from impvm.devstack.seed import REPO
        from impvm.devstack.stack import wait_for

        s = self.stack
        job = s.standin.queue_job(
            REPO, ["self-hosted", "imp"], name=f"pickup-{i}", sleep_seconds=self.args.job_seconds
        )

        async def started() -> bool:  # the record carries the time; 0.2 s only bounds the wait
            return job.started_at is not None

        await wait_for(f"job {job.id} in progress", started, self.args.timeout, s, 0.2)
        return job

    def timeline(self, job: Any, t_end: float) -> dict[str, float]:
        """Seconds from the job's queueing to each point of :data:`TIMELINE` it has."""
        s, tr = self.stack, self.tracer
        assert tr is not None
        vm = job.runner_name or ""
        at: dict[str, float] = dict(tr.vm.get(vm, {}))
        at["queued"] = job.created_at
        at["in_progress"] = job.started_at
        if vm in tr.online:
            at["online"] = tr.online[vm]
        log = list(s.standin.state.requests)
        jobs_url = f"/runs/{job.run_id}/jobs"
        for e in log:
            if e["time"] < job.created_at or e["time"] > t_end:
                continue
            if "poll-read" not in at and str(e.get("url", "")).endswith(jobs_url):
                at["poll-read"] = e["time"]
            if "jit" not in at and e.get("runner_name") == vm and e.get("status") == 201:
                at["jit"] = e["time"]
        handed = _log_times(s.service.data_dir / "operator.log", HANDOUT_RE)
        if vm in handed:
            at["handout"] = handed[vm]
        return {k: round(v - job.created_at, 3) for k, v in at.items()}

    async def demand(self, demand: str) -> dict[str, Any]:
        from impvm.devstack.seed import POOL

        s, a, tr = self.stack, self.args, self.tracer
        assert tr is not None
        await self.set_min_idle(0 if demand == "cold" else 1)
        samples: list[float] = []
        lines: list[dict[str, float]] = []
        vms_per_job: list[int] = []
        c0, t0 = await impvm_conflicts(s), time.time()
        for i in range(a.jobs):
            if demand == "cold":
                await self.wait_cold()
                await asyncio.sleep(self.rng.uniform(0, a.spread))
            else:
                await self.wait_warm()
            before = set(tr.vm)
            job = await self.one_job(i)
            took = job.started_at - job.created_at
            samples.append(took)
            if demand == "cold":
                lines.append(self.timeline(job, time.time()))
                vms_per_job.append(len(set(tr.vm) - before))
            print(
                f"  {a.runtime} {demand} {a.mode} {i + 1}/{a.jobs}: {took:.2f} s "
                f"(job {job.id}, runner {job.runner_name})",
                flush=True,
            )
        t1 = time.time()
        poll_starts = polls(list(s.standin.state.requests), t0, t1)
        gaps = [b - a_ for a_, b in itertools.pairwise(poll_starts)]
        out: dict[str, Any] = {
            "runtime": a.runtime,
            "mode": a.mode,
            "demand": demand,
            "tree": a.tree_label,
            "n": len(samples),
            "p50": round(statistics.median(samples), 3),
            "p95": round(pct(samples, 95), 3),
            "min": round(min(samples), 3),
            "max": round(max(samples), 3),
            "samples": [round(x, 3) for x in samples],
            "conflicts": await impvm_conflicts(s) - c0,
            "poll_interval_p50": round(statistics.median(gaps), 2) if gaps else None,
            "poll_intervals": [round(g, 2) for g in gaps],
            "load": os.getloadavg(),
            "pool": POOL,
        }
        if lines:
            out["timeline"] = lines
            out["vms_per_job"] = vms_per_job
        return out

    async def run(self) -> list[dict[str, Any]]:
        from impvm.devstack.devconfig import StackConfig
        from impvm.devstack.seed import POOL
        from impvm.devstack.stack import Stack, wait_for

        a = self.args
        wd = Path(tempfile.mkdtemp(prefix="impvm-pickup-"))
        self.stack = s = Stack(
            StackConfig(
                workdir=wd,
                runtime=a.runtime,
                polling_interval_seconds=a.poll_interval,
                scaling_mode=a.mode,
            )
        )
        results: list[dict[str, Any]] = []
        try:
            await s.start()
            assert s.service is not None
            self.tracer = Tracer(s, POOL, s.service.data_dir / f"agent-{s.service.node_name}")
            self.tracer.start()

            async def passed() -> bool:
                return "observedGeneration" in await s.pool_status()

            await wait_for("the pool's first pass", passed, a.timeout, s, 0.5)
            for demand in a.demand:
                res = await self.demand(demand)
                results.append(res)
                print(summary_line(res), flush=True)
                if res.get("timeline"):
                    print(breakdown(res), flush=True)
                print("PICKUP " + json.dumps(res), flush=True)
        finally:
            if self.tracer is not None:
                await self.tracer.stop()
            await s.stop()
            shutil.rmtree(wd, ignore_errors=True)  # etcd's data holds the App key
        return results


def summary_line(r: dict[str, Any]) -> str:
    return (
        f"pickup {r['runtime']} {r['demand']}: p50 {r['p50']:.2f} s p95 {r['p95']:.2f} s "
        f"n={r['n']} [{r['mode']}, {r['tree']}]"
    )


def breakdown(r: dict[str, Any]) -> str:
    """The cold timeline: per point, the median seconds after queueing and the median step
    from the point before it (per job), and how many jobs had the point."""
    lines: list[dict[str, float]] = r["timeline"]
    rows = [
        f"  where the cold wait went ({r['runtime']}, {r['mode']}, {r['tree']}; "
        "seconds after the job was queued, median over jobs):",
        f"  {'point':<48} {'p50 at':>7} {'p95 at':>7} {'p50 step':>8} {'jobs':>5}",
    ]
    prev: str | None = None
    for key, label in TIMELINE:
        have = [ln for ln in lines if key in ln]
        if not have:
            continue
        at = [ln[key] for ln in have]
        steps = [ln[key] - ln[prev] for ln in have if prev is not None and prev in ln]
        step = f"{statistics.median(steps):8.2f}" if steps else f"{'':8}"
        rows.append(
            f"  {label:<48} {statistics.median(at):7.2f} {pct(at, 95):7.2f} {step} {len(have):5}"
        )
        if key != "phase:Running":
            prev = key
    gaps = r.get("poll_intervals") or []
    if gaps:
        rows.append(
            f"  polls: {len(gaps) + 1}, interval p50 {statistics.median(gaps):.1f} s "
            f"(min {min(gaps):.1f}, max {max(gaps):.1f})"
        )
    rows.append(
        f"  VMs created per job: {collections.Counter(r.get('vms_per_job') or [])}; ImpVM "
        f"writes answered 409 (conflicts): {r['conflicts']}"
    )
    return "\n".join(rows)


def child(args: argparse.Namespace) -> None:
    asyncio.run(Measure(args).run())


# ---------------------------------------------------------------------- the driver (parent)


def tree_label(tree: Path) -> str:
    """The checkout's short commit (``+dirty`` when it has uncommitted changes)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return tree.name
    return head + ("+dirty" if dirty else "")


def run_child(tree: Path, argv: list[str], timeout: float) -> list[dict[str, Any]]:
    """This script's measurement with ``tree``'s Python and ``impvm``; its output is echoed.
    Returns its ``PICKUP`` results (none when it failed or timed out)."""
    py = tree / ".venv" / "bin" / "python"
    if not py.is_file():
        raise SystemExit(f"pickup: {py} not found (run scripts/setup.sh in {tree})")
    cmd = [str(py), str(HERE / "pickup.py"), "--measure", *argv, "--tree-label", tree_label(tree)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    p = subprocess.Popen(
        cmd,
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout ends it and everything it started
    )
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    try:
        for line in p.stdout:
            if line.startswith("PICKUP "):
                out.append(json.loads(line[len("PICKUP ") :]))
            print(line, end="", flush=True)
            if time.monotonic() > deadline:
                raise TimeoutError
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        print(f"[pickup: timed out after {timeout:.0f} s]", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if p.returncode != 0:
        print(f"[pickup: measurement exited {p.returncode}]", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    ap.add_argument("--demand", nargs="+", choices=DEMANDS, default=list(DEMANDS))
    ap.add_argument(
        "--mode",
        nargs="+",
        choices=MODES,
        default=["polling"],
        help="the pool's scaling.mode (default: polling, as impvm dev up ships)",
    )
    ap.add_argument("--jobs", type=int, default=20, help="jobs per runtime, mode and demand")
    ap.add_argument("--poll-interval", type=int, default=5, help="polling.intervalSeconds")
    ap.add_argument("--job-seconds", type=float, default=1.0, help="each job's sleep_seconds")
    ap.add_argument(
        "--spread", type=float, default=10.0, help="cold: random pause before each job, up to s"
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of each wait, s")
    ap.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="another checkout (with its .venv) to measure the same against: the baseline",
    )
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree-label", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.measure:
        args.runtime, args.mode = args.runtime[0], args.mode[0]
        args.tree_label = args.tree_label or tree_label(ROOT)
        child(args)
        return
    common = [
        "--demand",
        *args.demand,
        "--jobs",
        str(args.jobs),
        "--poll-interval",
        str(args.poll_interval),
        "--job-seconds",
        str(args.job_seconds),
        "--spread",
        str(args.spread),
        "--timeout",
        str(args.timeout),
    ]
    trees = [ROOT] + ([args.tree.resolve()] if args.tree else [])
    # a whole measurement: every wait bounded, plus the stack's start and stop
    limit = 600 + len(args.demand) * args.jobs * (args.timeout + args.spread)
    results: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    t_all = time.monotonic()
    for mode in args.mode:
        for runtime in args.runtime:
            for which, tree in enumerate(trees):
                argv = ["--runtime", runtime, "--mode", mode, *common]
                for r in run_child(tree, argv, limit):
                    results.append({**r, "checkout": "baseline" if which else "this"})
    load1 = os.getloadavg()
    print()
    for r in results:
        print(summary_line(r))
    if args.tree:
        key = ("runtime", "mode", "demand")
        base = {tuple(r[k] for k in key): r for r in results if r["checkout"] == "baseline"}
        for r in results:
            b = base.get(tuple(r[k] for k in key))
            if r["checkout"] != "this" or b is None or not b["p50"] or not b["p95"]:
                continue
            print(
                f"pickup {r['runtime']} {r['demand']} [{r['mode']}]: {r['tree']} / {b['tree']} "
                f"p50 {r['p50'] / b['p50']:.2f}x p95 {r['p95'] / b['p95']:.2f}x"
            )
    print(
        f"{os.cpu_count()} cores; load average {load0[0]:.1f} at start, {load1[0]:.1f} at end; "
        f"{(time.monotonic() - t_all) / 60:.1f} min"
    )
    want = len(args.mode) * len(args.runtime) * len(trees) * len(args.demand)
    if len(results) < want:
        print(f"pickup: {want - len(results)} measurement(s) missing (see above)")
        sys.exit(1)


if __name__ == "__main__":
    main()
