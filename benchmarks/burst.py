"""Burst run: bursts of short jobs on the embedded stack, counting what each job cost.

The stack (:class:`impvm.devstack.stack.Stack`): a real control plane, the operator, one agent
with the ``process`` runtime, the GitHub stand-in delivering signed ``workflow_job`` webhooks. The
example pool runs in ``hybrid`` mode (webhooks plus a poll every 30 s) at ``minIdle`` 0,
``maxConcurrent`` 6, ``scaleUpStep`` 6 and ``cooldownSeconds`` 0. Every ``--gap`` seconds
``--size`` jobs of ``--job-seconds`` each are queued at once, ``--bursts`` times; then the run
waits (bounded by ``--timeout``) until every job completed and the pool is back at 0 VMs.

    KUBEBUILDER_ASSETS=$(bash scripts/setup.sh) .venv/bin/python benchmarks/burst.py

Columns: ``jobs``, ``JIT mints`` (generate-jitconfig calls GitHub answered 201), ``mints per
job``, ``busy deregistrations`` (runner deletions GitHub refused with 422
because the runner was running a job), ``seconds``. A pool that sizes itself right mints one
JIT config per job (``minIdle`` 0) and never asks GitHub to delete a busy runner. Exit status 1
when either is not so.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lightkube.types import PatchType

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE, POOL
from impvm.devstack.stack import Stack, wait_for

JIT_PATH = "/orgs/{org}/actions/runners/generate-jitconfig"
RUNNER_PATH = "/orgs/{org}/actions/runners/{runner_id}"


@dataclass
class Result:
    jobs: int = 0
    completed: int = 0
    mints: int = 0
    busy_deregistrations: int = 0
    seconds: float = 0.0


async def run(args: argparse.Namespace) -> Result:
    res = Result(jobs=args.bursts * args.size)
    wd = Path(tempfile.mkdtemp(prefix="impvm-burst-"))
    stack = Stack(StackConfig(workdir=wd / "stack", scaling_mode="hybrid"))
    try:
        await stack.start()
        assert stack.standin is not None and stack.kube is not None
        await stack.kube.patch(
            ImpVMRunnerPoolResource,
            POOL,
            {
                "spec": {
                    "scaling": {
                        "minIdle": 0,
                        "maxConcurrent": args.size,
                        "scaleUpStep": args.size,
                        "cooldownSeconds": 0,
                    }
                }
            },
            namespace=NAMESPACE,
            patch_type=PatchType.MERGE,
        )

        async def empty() -> bool:
            return not await stack.vms() and not stack.runners()

        await wait_for("the pool at 0 VMs", empty, 240, stack)
        st = stack.standin.state
        before = len(st.requests)
        t0 = time.monotonic()
        ids: list[int] = []
        for b in range(args.bursts):
            ids += stack.queue_jobs(args.size, sleep=args.job_seconds)
            if b + 1 < args.bursts:
                await asyncio.sleep(args.gap)

        async def done() -> bool:
            jobs = {j.id: j for j in stack.jobs()}
            finished = all(jobs[i].status == "completed" for i in ids)
            return finished and await empty()

        await wait_for("every job done and the pool at 0 VMs", done, args.timeout, stack)
        res.seconds = time.monotonic() - t0
        requests = st.requests[before:]
        res.mints = sum(1 for r in requests if r["path"] == JIT_PATH and r.get("status") == 201)
        res.busy_deregistrations = sum(
            1
            for r in requests
            if r["method"] == "DELETE" and r["path"] == RUNNER_PATH and r.get("status") == 422
        )
        jobs = {j.id: j for j in stack.jobs()}
        res.completed = sum(1 for i in ids if jobs[i].conclusion == "success")
    finally:
        await stack.stop()
        shutil.rmtree(wd, ignore_errors=True)
    return res


def table(r: Result) -> str:
    per = r.mints / r.jobs if r.jobs else 0.0
    head = "| jobs | completed | JIT mints | mints per job | busy deregistrations | seconds |"
    rule = "| ---: | ---: | ---: | ---: | ---: | ---: |"
    row = (
        f"| {r.jobs} | {r.completed} | {r.mints} | {per:.2f} | {r.busy_deregistrations} "
        f"| {r.seconds:.0f} |"
    )
    return "\n".join((head, rule, row))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, default=10, help="bursts of jobs (default 10)")
    ap.add_argument("--size", type=int, default=6, help="jobs per burst = maxConcurrent (6)")
    ap.add_argument("--gap", type=float, default=20.0, help="seconds between bursts (20)")
    ap.add_argument("--job-seconds", type=float, default=2.0, help="each job's length (2 s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on the run (600 s)")
    return ap.parse_args(argv)


def main() -> int:
    args = parse()
    r = asyncio.run(run(args))
    print(table(r))
    ok = r.mints == r.jobs and r.busy_deregistrations == 0 and r.completed == r.jobs
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
