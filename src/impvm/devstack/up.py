"""``impvm dev up``: ``impvm up`` (:func:`impvm.up.main.serve`) with a generated configuration
(:mod:`impvm.devstack.stack`: the GitHub stand-in, a loopback registry with the test images, the
minimal example as the pool), shown live.

It prints the generated ``impvm.yaml`` and the ``KUBECONFIG`` to use, then the pool, its VMs, the
runners GitHub knows and the jobs, refreshed every second. ``--jobs N`` queues N jobs matching
the pool's labels once the pool has its idle runner; ``--until-done`` exits 0 once they all ran
and the pool is back at minIdle, and non-zero (with the reason) on timeout or when a process dies
(without ``--until-done`` a dead process is restarted, as ``impvm up`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from lightkube.core.exceptions import ApiError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from impvm.commands.status import read_snapshot
from impvm.commands.statusview import cell, render, summarize
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE, POOL
from impvm.devstack.stack import Stack
from impvm.up.main import serve
from impvm.up.service import Service

MIN_IDLE = 1  # the minimal example's minIdle


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
            cell(st.get("phase")),
            cell(v["spec"].get("nodeName")),
            cell(r.get("id")),
            cell(r.get("online")),
            cell(r.get("busy")),
            cell(job.get("id")),
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
    """One line of the pool's status; ``waiting`` until the operator has written it."""
    if not status:
        return f"pool {POOL}: waiting for the operator's first status"
    conds = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return (
        f"pool {POOL}: idle {cell(status.get('idle'))} busy {cell(status.get('busy'))} "
        f"starting {cell(status.get('starting'))} total {cell(status.get('total'))} "
        f"desired {cell(status.get('desired'))} pendingJobs {cell(status.get('pendingJobs'))} "
        f"Ready={conds.get('Ready', 'waiting')}"
    )


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


@dataclass
class _Show:
    """The live view and the --jobs/--until-done logic, one tick a second."""

    stack: Stack
    console: Console
    jobs: int
    until_done: bool
    limit: float
    started: float = field(default_factory=time.monotonic)
    job_ids: list[int] = field(default_factory=list)
    last_line: str = ""
    live: Live | None = None
    ready: bool = False

    async def tick(self, service: Service) -> int | None:
        stack = self.stack
        if not self.ready:
            self.ready = True
            await stack.after_start()
            assert stack.standin is not None
            self.console.print(
                f"  {service.control_plane.kubectl if service.control_plane else 'kubectl'}"
                f" get imprp,impvm\nGitHub stand-in {stack.standin.url}  logs in "
                f"{service.data_dir}/*.log"
            )
            if self.console.is_terminal:
                self.live = Live(console=self.console, refresh_per_second=2)
                self.live.start()
        try:
            status = await stack.pool_status()
            vms = await stack.vms()
            if self.live is not None:
                assert stack.kube is not None
                view = render(summarize(await read_snapshot(stack.kube, NAMESPACE)))
                self.live.update(Group(view, _vm_table(vms), _github_table(stack)))
        except (httpx2.TransportError, ApiError) as e:
            # the API server is being restarted (the service does that): show it, go on
            line = f"API server not answering ({type(e).__name__})"
            if line != self.last_line and self.live is None:
                self.console.print(f"[{time.monotonic() - self.started:5.0f}s] {line}")
                self.last_line = line
            return None
        line = _pool_line(status)
        if self.live is None and line != self.last_line:
            self.console.print(f"[{time.monotonic() - self.started:5.0f}s] {line}")
            self.last_line = line
        if self.jobs and not self.job_ids and status.get("idle", 0) >= MIN_IDLE:
            self.job_ids = stack.queue_jobs(self.jobs)
            self.console.print(f"queued {self.jobs} job(s) needing self-hosted, imp")
        if not self.until_done:
            return None
        if (self.job_ids or not self.jobs) and _done(stack, self.job_ids, status, len(vms)):
            self.console.print(
                f"done: {len(self.job_ids)} job(s) ran, pool back at minIdle "
                f"{MIN_IDLE} after {time.monotonic() - self.started:.0f}s"
            )
            return 0
        if time.monotonic() - self.started > self.limit:
            done = sum(1 for j in stack.jobs() if j.status == "completed")
            self.console.print(
                f"impvm dev up: timed out after {self.limit:.0f}s: {done}/{len(self.job_ids)} "
                f"job(s) completed; {line}"
            )
            return 1
        return None

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


async def _run(
    runtime: str, jobs: int, until_done: bool, workdir: Path, limit: float, console: Console
) -> int:
    stack = Stack(StackConfig(workdir=workdir, runtime=runtime, polling_interval_seconds=5))
    console.print(f"starting the embedded stack in {workdir} (runtime {runtime})")
    show = _Show(stack, console, jobs, until_done, limit)

    async def make() -> Service:
        service = await stack.start_fixtures()
        console.print(f"impvm up --config {stack.config_file}  (generated)")
        return service

    try:
        code = await serve(
            make,
            restart_crashed=not until_done,
            tick=show.tick,
            say=console.print,
            interrupted_code=130 if until_done else 0,
        )
        if code == 130 and until_done and show.ready:
            console.print("impvm dev up: interrupted before the jobs were done")
        return code
    finally:
        show.close()
        with contextlib.suppress(Exception):
            await stack.stop()


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
