"""``impvm dev up``: the embedded stack (:mod:`impvm.devstack.stack`), shown live.

Starts the control plane with the CRDs, the GitHub stand-in, a loopback registry with the test
images, the operator and one agent, applies the seed's minimal example, and shows the pool, its
VMs, the runners GitHub knows and the jobs, refreshed every second. ``--jobs N`` queues N jobs
matching the pool's labels once the pool has its idle runner; ``--until-done`` exits 0 once they
all ran and the pool is back at minIdle, and non-zero (with the reason) on timeout or when a
stack process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from impvm.devstack.stack import Stack, StackConfig

MIN_IDLE = 1  # the seed example's minIdle


def _vm_table(vms: list[dict[str, Any]]) -> Table:
    t = Table(title="ImpVMs", expand=True)
    for col in ("name", "phase", "node", "runner", "online", "busy", "job"):
        t.add_column(col)
    for v in sorted(vms, key=lambda v: v["metadata"]["creationTimestamp"]):
        st = v.get("status") or {}
        r = st.get("runner") or {}
        job = st.get("job") or {}
        name = v["metadata"]["name"] + (
            " (deleting)" if v["metadata"].get("deletionTimestamp") else ""
        )
        t.add_row(
            name,
            str(st.get("phase", "")),
            str(v["spec"].get("nodeName", "")),
            str(r.get("id", "")),
            str(r.get("online", "")),
            str(r.get("busy", "")),
            str(job.get("id", "")),
        )
    return t


def _github_table(stack: Stack) -> Table:
    t = Table(title="GitHub (stand-in)", expand=True)
    for col in ("job", "status", "conclusion", "runner"):
        t.add_column(col)
    for j in stack.jobs()[-15:]:
        t.add_row(str(j.id), j.status, str(j.conclusion or ""), str(j.runner_name or ""))
    runners = ", ".join(
        f"{r.name}({r.status}{', busy' if r.busy else ''})" for r in stack.runners()
    )
    t.caption = f"runners: {runners or 'none'}"
    return t


def _pool_line(status: dict[str, Any]) -> str:
    conds = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return (
        f"pool ci-pool: idle {status.get('idle')} busy {status.get('busy')} "
        f"starting {status.get('starting')} total {status.get('total')} "
        f"desired {status.get('desired')} pendingJobs {status.get('pendingJobs')} "
        f"Ready={conds.get('Ready', '?')}"
    )


async def _view(stack: Stack) -> tuple[Group, str]:
    status = await stack.pool_status()
    line = _pool_line(status)
    return Group(line, _vm_table(await stack.vms()), _github_table(stack)), line


def _done(stack: Stack, job_ids: list[int], status: dict[str, Any], vms: int) -> bool:
    jobs = [j for j in stack.jobs() if j.id in job_ids]
    return (
        len(jobs) == len(job_ids)
        and all(j.status == "completed" for j in jobs)
        and status.get("idle") == MIN_IDLE
        and status.get("total") == MIN_IDLE
        and vms == MIN_IDLE
        and len(stack.runners()) == MIN_IDLE
    )


async def _run(
    runtime: str, jobs: int, until_done: bool, workdir: Path, limit: float, console: Console
) -> int:
    stack = Stack(StackConfig(workdir=workdir, runtime=runtime, polling_interval_seconds=5))
    console.print(f"starting the embedded stack in {workdir} (runtime {runtime})")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before starting: Ctrl-C during start-up works
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(stack.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        console.print("impvm dev up: interrupted while starting; stopping the stack")
        await stack.stop()
        return 130
    stopping.cancel()
    if starting.exception() is not None:
        e = starting.exception()
        console.print(f"impvm dev up: the stack did not start: {type(e).__name__}: {e}")
        await stack.stop()
        return 1
    assert stack.control_plane is not None and stack.standin is not None
    console.print(
        f"control plane {stack.control_plane.url}\n"
        f"  export KUBECONFIG={stack.kubeconfig}\n"
        f"  {stack.control_plane.kubectl} get imprp,impvm\n"
        f"GitHub stand-in {stack.standin.url}  operator http://127.0.0.1:"
        f"{stack.operator_http_port}/metrics  logs in {workdir}/*.log"
    )
    job_ids: list[int] = []
    started = time.monotonic()
    code = 0
    last_line = ""
    live = Live(console=console, refresh_per_second=2) if console.is_terminal else None
    try:
        with live if live is not None else contextlib.nullcontext():
            while not stop.is_set():
                stack.check_processes()
                view, line = await _view(stack)
                if live is not None:
                    live.update(view)
                elif line != last_line:
                    console.print(f"[{time.monotonic() - started:5.0f}s] {line}")
                    last_line = line
                status = await stack.pool_status()
                if jobs and not job_ids and status.get("idle", 0) >= MIN_IDLE:
                    job_ids = stack.queue_jobs(jobs)
                    console.print(f"queued {jobs} job(s) needing self-hosted, imp")
                if until_done and (job_ids or not jobs):
                    if _done(stack, job_ids, status, len(await stack.vms())):
                        console.print(
                            f"done: {len(job_ids)} job(s) ran, pool back at minIdle "
                            f"{MIN_IDLE} after {time.monotonic() - started:.0f}s"
                        )
                        break
                if until_done and time.monotonic() - started > limit:
                    done = sum(1 for j in stack.jobs() if j.status == "completed")
                    console.print(
                        f"impvm dev up: timed out after {limit:.0f}s: {done}/{len(job_ids)} "
                        f"job(s) completed; {line}"
                    )
                    code = 1
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
    except RuntimeError as e:
        console.print(f"impvm dev up: {e}")
        code = 1
    finally:
        if stop.is_set() and until_done and code == 0:
            console.print("impvm dev up: interrupted before the jobs were done")
            code = 130
        console.print("stopping the stack")
        await stack.stop()
    return code


def run(
    runtime: str, jobs: int, until_done: bool, workdir: str | None, timeout: float = 900.0
) -> int:
    """Run the embedded stack; return the process exit code."""
    if runtime not in ("process", "qemu"):
        print(f"impvm dev up: unknown runtime {runtime!r} (process or qemu)", file=sys.stderr)
        return 2
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="impvm-dev-"))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160, soft_wrap=True)
    try:
        return asyncio.run(_run(runtime, jobs, until_done, base, timeout, console))
    finally:
        if not workdir:
            # etcd's data holds the App private key and JIT Secrets: never leave it behind
            shutil.rmtree(base, ignore_errors=True)
