"""Benchmark: a fleet of N pools x M VMs created through the ``imp.dev/runner-demand``
annotation (or, ``--demand jobs``, for M queued jobs per pool in the stand-in), on the embedded
stack (real control plane, operator process, GitHub stand-in; no agent unless ``--agent``), in
webhook or polling mode, with 1, 50 or 500 repositories in the organisation (the stand-in is
seeded with them). The example pool (minIdle 1) runs beside the N pools and is not counted.

For each run it reports:

* the time from setting the annotation on every pool to every VM having its JIT Secret, and the
  rate (VMs a minute);
* GitHub calls by endpoint during creation (from the stand-in's request log; 304s counted
  apart), and per VM created;
* after ``--settle`` seconds, over a quiet window of ``--quiet`` seconds in which nothing
  changes: the operator process's CPU time (``utime + stime`` from ``/proc/<pid>/stat``, as a
  share of one core), its RSS (``VmRSS`` of ``/proc/<pid>/status``, last and peak of samples),
  and GitHub calls a minute by endpoint;
* the load average of the machine, which is shared.

Baselines in the same run: the time this process takes to create the same number of ImpVMs and
Secrets directly through the API server (8 at a time; the floor any controller pays), and the RSS
and CPU of an idle Python process that has imported the operator (the floor of its memory).

Bounded and loopback only: every wait has a deadline, the stack is stopped and its directory
removed at the end. The last line of each run is ``FLEET {json}`` for ``benchmarks/run.py``.

    KUBEBUILDER_ASSETS=$(bash scripts/setup.sh) .venv/bin/python benchmarks/fleet.py \\
        --pools 10 --vms 20 --mode webhook --repos 1
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightkube.core.client import PatchType
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.api.models import DEMAND_ANNOTATION
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE, ORG, REPO
from impvm.devstack.stack import Stack, wait_for

POOL_LABEL = "imp.dev/runner-pool"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (fields 14 and 15 of /proc/<pid>/stat)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def by_endpoint(log: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """``{"GET /orgs/{org}/actions/runners": {"200": n, "304": m}, ...}``."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in log:
        out[f"{e['method']} {e['path']}"][str(e.get("status", "?"))] += 1
    return {k: dict(v) for k, v in sorted(out.items(), key=lambda kv: -sum(kv[1].values()))}


def kube_requests_since(log: Path, offset: int) -> dict[str, int]:
    """Kubernetes API requests the operator logged (its HTTP client logs each one, watches
    when they start) after byte ``offset`` of its log, by method and kind of path."""
    out: collections.Counter[str] = collections.Counter()
    with log.open("rb") as f:
        f.seek(offset)
        for raw in f:
            line = raw.decode(errors="replace")
            if "HTTP Request:" not in line or "/api" not in line:
                continue
            method, _, rest = line.split("HTTP Request: ", 1)[1].partition(" ")
            url = rest.split(" ", 1)[0]
            parts = url.split("?", 1)[0].split("/")
            kinds = [p for p in parts if p and p[0].isalpha() and p.endswith("s")]
            kind = kinds[-1] if kinds else "?"
            out[f"{method} {kind}{' (watch)' if 'watch=' in url else ''}"] += 1
    return dict(out)


def total_calls(eps: dict[str, dict[str, int]]) -> tuple[int, int]:
    """(all calls, of which 304) — the token endpoint included."""
    n = sum(sum(v.values()) for v in eps.values())
    return n, sum(v.get("304", 0) for v in eps.values())


POLL_PATHS = (
    "/installation/repositories",
    "/repos/{owner}/{repo}/actions/runs",
    "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs",
)


def poll_cost(log: list[dict[str, Any]], t0: float, t1: float, gap: float = 5.0) -> dict[str, Any]:
    """Polls in the stand-in's log between ``t0`` and ``t1`` (epoch s): the poll requests
    (repository listings, run listings, jobs lists) grouped into polls by pauses of more than
    ``gap`` seconds (the installation's poller reads serially; polls are an interval apart).
    Returns polls seen, requests and 304s per poll (median, max), the repositories whose runs
    were read, and the sweep: seconds from ``t0`` until every repository seen in the window
    had its runs read at least once, and the longest time between two reads of one
    repository's runs."""
    reqs = [e for e in log if e.get("path") in POLL_PATHS and t0 <= e["time"] <= t1]
    polls: list[list[dict[str, Any]]] = []
    for e in sorted(reqs, key=lambda e: e["time"]):
        if not polls or e["time"] - polls[-1][-1]["time"] > gap:
            polls.append([])
        polls[-1].append(e)
    sizes = sorted(len(p) for p in polls)
    n304 = sorted(sum(1 for e in p if e.get("status") == 304) for p in polls)
    runs = POLL_PATHS[1]
    reads: dict[str, list[float]] = collections.defaultdict(list)
    for e in reqs:
        if e["path"] == runs:
            reads[e.get("url", "?")].append(e["time"])
    first = max((min(ts) for ts in reads.values()), default=t0)
    longest = max(
        (b - a for ts in reads.values() for a, b in zip(sorted(ts), sorted(ts)[1:], strict=False)),
        default=0.0,
    )
    return {
        "polls": len(polls),
        "calls_per_poll_median": sizes[len(sizes) // 2] if sizes else 0,
        "calls_per_poll_max": sizes[-1] if sizes else 0,
        "calls_304_per_poll_median": n304[len(n304) // 2] if n304 else 0,
        "repos_read": len(reads),
        "sweep_seconds": round(first - t0, 1),
        "longest_between_reads_seconds": round(longest, 1),
    }


async def idle_floor(seconds: float) -> tuple[float, float]:
    """RSS (MiB) and CPU (share of a core) of a Python process that imported the operator and
    sleeps for ``seconds``."""
    code = (
        "import time, impvm.operator.handlers, impvm.cli; print('ready', flush=True); "
        "time.sleep(600)"
    )
    p = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert p.stdout is not None
        await p.stdout.readline()
        c0 = cpu_seconds(p.pid)
        await asyncio.sleep(seconds)
        return rss_mib(p.pid), (cpu_seconds(p.pid) - c0) / seconds
    finally:
        p.kill()
        await p.wait()


async def direct_create(s: Stack, n: int) -> float:
    """Seconds to create ``n`` ImpVMs + Secrets directly (8 at a time) in a namespace no pool
    watches."""
    assert s.kube is not None and s.images is not None
    ns = "fleet-baseline"
    await s.kube.create(Namespace(metadata=ObjectMeta(name=ns)))
    sem = asyncio.Semaphore(8)
    image = s.images.base

    async def one(i: int) -> None:
        assert s.kube is not None
        async with sem:
            await s.kube.create(
                ImpVMResource.from_dict(
                    {
                        "metadata": {"name": f"baseline-{i}", "namespace": ns},
                        "spec": {"classRef": {"name": "runner-class"}, "image": image},
                    }
                )
            )
            await s.kube.create(
                Secret(
                    metadata=ObjectMeta(name=f"baseline-{i}-jit", namespace=ns),
                    data={"jitconfig": base64.b64encode(b"x").decode()},
                )
            )

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


async def ready_per_pool(s: Stack, names: set[str]) -> collections.Counter[str]:
    """Per pool: VMs whose ``spec.runnerConfigSecret`` names an existing Secret."""
    assert s.kube is not None
    secrets = {o.metadata.name async for o in s.kube.list(Secret, namespace=NAMESPACE)}  # type: ignore[union-attr]
    out: collections.Counter[str] = collections.Counter()
    async for vm in s.kube.list(ImpVMResource, namespace=NAMESPACE):
        d = vm.to_dict()
        pool = (d["metadata"].get("labels") or {}).get(POOL_LABEL)
        ref = d.get("spec", {}).get("runnerConfigSecret")
        if pool in names and ref and ref in secrets:
            out[pool] += 1
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    wd = Path(tempfile.mkdtemp(prefix="impvm-fleet-"))
    s = Stack(
        StackConfig(
            workdir=wd,
            scaling_mode=args.mode,
            start_agent=args.agent,
            apply_example=True,
            polling_interval_seconds=args.poll_interval,
            # loopback only; the agent's guests reach the stand-in through a namespace of its own
            isolated_network=None if args.agent else False,
        )
    )
    result: dict[str, Any] = {
        "mode": args.mode,
        "pools": args.pools,
        "vms_per_pool": args.vms,
        "repos": args.repos,
        "demand": args.demand,
        "agent": args.agent,
        "load_start": os.getloadavg(),
    }
    try:
        service = await s.start_fixtures()
        assert s.standin is not None
        # the organisation's repositories: ORG/app plus repos-1 more (the installation sees all)
        repos = [REPO] + [f"{ORG}/repo-{i:03d}" for i in range(args.repos - 1)]
        for r in repos[1:]:
            s.standin.state.add_repo(r)
        await service.start(start_agent=args.agent)
        await s.after_start()
        assert s.kube is not None
        pid = s.procs["operator"].pid
        names = [f"fleet-{i:03d}" for i in range(args.pools)]
        for n in names:
            await s.add_pool(n, [n], min_idle=0, max_concurrent=args.vms, scale_up_step=args.vms)

        async def all_passed() -> bool:
            return all(["observedGeneration" in await s.pool_status(n) for n in names])

        await wait_for("every pool's first pass", all_passed, args.timeout, s, interval=1)
        log = s.standin.state.requests
        startup_calls = len(log)
        log.clear()
        spy = profiler(args.profile, pid, "create") if args.profile else None
        c0 = cpu_seconds(pid)
        t0 = time.monotonic()
        for n in names:
            if args.demand == "jobs":
                # real queued jobs, spread over the repositories; webhooks are delivered for
                # them in webhook mode, the poller finds them in polling mode
                for j in range(args.vms):
                    repo = repos[(names.index(n) * args.vms + j) % len(repos)]
                    s.standin.queue_job(repo, ["self-hosted", n], name=f"{n}-{j}")
                continue
            await s.kube.patch(
                ImpVMRunnerPoolResource,
                n,
                {"metadata": {"annotations": {DEMAND_ANNOTATION: str(args.vms)}}},
                namespace=NAMESPACE,
                patch_type=PatchType.MERGE,
            )
        want = args.pools * args.vms
        interval = 1.0 if want <= 300 else 2.0
        progress: list[tuple[float, int]] = []

        async def all_ready() -> bool:
            got = await ready_per_pool(s, set(names))
            progress.append((time.monotonic() - t0, sum(got.values())))
            return sum(got.values()) >= want

        await wait_for("every VM with its Secret", all_ready, args.timeout, s, interval=interval)
        took = time.monotonic() - t0
        create_cpu = cpu_seconds(pid) - c0
        create_eps = by_endpoint(list(log))
        n_create, n_create_304 = total_calls(create_eps)
        result.update(
            startup_calls=startup_calls,
            vms=want,
            create_seconds=round(took, 1),
            create_per_min=round(want / took * 60, 1),
            create_cpu_seconds=round(create_cpu, 1),
            create_calls=n_create,
            create_calls_304=n_create_304,
            calls_per_vm=round(n_create / want, 2),
            create_endpoints=create_eps,
        )
        print(
            f"created {want} VMs with Secrets in {took:.1f}s ({want / took * 60:.0f}/min), "
            f"operator CPU {create_cpu:.1f}s, GitHub calls {n_create} "
            f"({n_create / want:.2f}/VM, {n_create_304} 304s)",
            flush=True,
        )
        stop_profiler(spy)
        await asyncio.sleep(args.settle)
        log.clear()
        spy = profiler(args.profile, pid, "quiet") if args.profile else None
        rss: list[float] = []
        kube_log = service.data_dir / "operator.log"
        kube_mark = kube_log.stat().st_size
        c1, t1, wall1 = cpu_seconds(pid), time.monotonic(), time.time()
        while time.monotonic() - t1 < args.quiet:
            await asyncio.sleep(min(5.0, args.quiet - (time.monotonic() - t1) + 0.01))
            rss.append(rss_mib(pid))
            s.check_processes()
        window = time.monotonic() - t1
        idle_cpu = cpu_seconds(pid) - c1
        kube_requests = kube_requests_since(kube_log, kube_mark)
        stop_profiler(spy)
        idle_eps = by_endpoint(list(log))
        polled = poll_cost(list(log), wall1, time.time())
        n_idle, n_idle_304 = total_calls(idle_eps)
        result.update(
            quiet_seconds=round(window, 1),
            idle_cpu_seconds=round(idle_cpu, 2),
            idle_cpu_share=round(idle_cpu / window, 4),
            rss_mib=round(rss[-1], 1),
            rss_peak_mib=round(max(rss), 1),
            idle_calls_per_min=round(n_idle / window * 60, 1),
            idle_kube_requests_per_min=round(sum(kube_requests.values()) / window * 60, 1),
            idle_kube_requests=kube_requests,
            idle_calls_304=n_idle_304,
            idle_endpoints=idle_eps,
            idle_polls=polled,
        )
        print(
            f"quiet {window:.0f}s: operator CPU {idle_cpu:.2f}s ({idle_cpu / window:.1%} of a "
            f"core), RSS {rss[-1]:.0f} MiB (peak {max(rss):.0f}), GitHub "
            f"{n_idle / window * 60:.1f} calls/min ({n_idle_304} 304s), Kubernetes API "
            f"{sum(kube_requests.values()) / window * 60:.1f} requests/min {kube_requests}",
            flush=True,
        )
        print(
            f"polls in the quiet window: {polled['polls']}, requests per poll median "
            f"{polled['calls_per_poll_median']} (max {polled['calls_per_poll_max']}, median "
            f"{polled['calls_304_per_poll_median']} 304s); runs of {polled['repos_read']} "
            f"repositories read, all within {polled['sweep_seconds']}s, at most "
            f"{polled['longest_between_reads_seconds']}s between two reads of one",
            flush=True,
        )
        for phase, eps in (("creation", create_eps), ("quiet", idle_eps)):
            for ep, st in eps.items():
                print(f"  {phase:8s} {ep}: {st}", flush=True)
        if args.baseline:
            result["baseline_create_seconds"] = round(await direct_create(s, want), 1)
            frss, fcpu = await idle_floor(min(args.quiet, 30.0))
            result.update(baseline_rss_mib=round(frss, 1), baseline_idle_cpu_share=round(fcpu, 4))
            print(
                f"baseline: direct create {result['baseline_create_seconds']}s; idle python with "
                f"the operator imported: RSS {frss:.0f} MiB, CPU {fcpu:.1%}",
                flush=True,
            )
    finally:
        result["load_end"] = os.getloadavg()
        await s.stop()
        shutil.rmtree(wd, ignore_errors=True)  # etcd's data holds the App key
    return result


def profiler(out: Path, pid: int, phase: str) -> subprocess.Popen[bytes]:
    """``py-spy record`` of ``pid`` into ``out/<phase>.txt`` (collapsed stacks, 50 samples/s),
    until :func:`stop_profiler`."""
    out.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(spy), "record", "-p", str(pid), "-r", "50", "-f", "raw", "-o"]
    return subprocess.Popen([*cmd, str(out / f"{phase}.txt")], stdout=subprocess.DEVNULL)


def stop_profiler(spy: subprocess.Popen[bytes] | None) -> None:
    """Stop py-spy; it writes its file on SIGINT."""
    if spy is None:
        return
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", type=int, default=10)
    ap.add_argument("--vms", type=int, default=20, help="VMs per pool (the annotation's value)")
    ap.add_argument("--mode", choices=["webhook", "polling", "hybrid"], default="webhook")
    ap.add_argument("--repos", type=int, default=1, help="repositories in the organisation")
    ap.add_argument("--poll-interval", type=int, default=None, help="polling intervalSeconds")
    ap.add_argument(
        "--demand",
        choices=["annotation", "jobs"],
        default="annotation",
        help="annotation: imp.dev/runner-demand on each pool; jobs: queue M real jobs per pool",
    )
    ap.add_argument("--agent", action="store_true", help="run the agent (process runtime) too")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after creation")
    ap.add_argument("--quiet", type=float, default=60.0, help="seconds of the quiet window")
    ap.add_argument("--timeout", type=float, default=900.0, help="deadline of each wait")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="directory: py-spy samples the operator during creation and the quiet window "
        "(create.txt, quiet.txt: collapsed stacks, the flame graph's input)",
    )
    args = ap.parse_args()
    if args.repos < 1 or args.pools < 1 or args.vms < 1:
        ap.error("--pools, --vms and --repos must be at least 1")
    res = asyncio.run(run(args))
    print("FLEET " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
