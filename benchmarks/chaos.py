"""Chaos run: a burst of jobs on the embedded stack while the operator, the agent, GitHub and the
webhook path fail, then one table of what was lost. Every loss column must be 0.

The stack (:class:`impvm.devstack.stack.Stack`): a real control plane, two operator replicas
electing a leader on their Lease, one agent with the ``process`` runtime (bubblewrap sandboxes,
which die with a killed agent) or, with ``--runtime qemu``, QEMU VMs (they outlive a killed agent
and the next agent process re-attaches them), the GitHub stand-in, the example pool in
``hybrid`` mode (webhooks plus a poll every 5 s) with ``maxConcurrent`` 4. As root the stand-in
and every VM live in network namespaces the stack creates and deletes; otherwise everything is on
loopback. Webhooks travel stand-in -> a loopback relay in this process (it keeps each delivery
to replay it) -> the operator replicas, like a Service in front of them.

Faults, spread over the fault phase (``--fault-seconds``, at fixed times, neither seeking nor
avoiding busy runners), while ``--jobs`` jobs are queued over its first 80 %:

- ``kill -9`` of the leading operator replica, ten times (it is started again at once and comes
  back as a standby);
- ``kill -9`` of the agent, three times (started again at once);
- 20 % of all GitHub API calls answered 502 (the stand-in's ``probability`` failure);
- 30 % of webhook deliveries lost (the stand-in's ``drop_rate``);
- the installation's rate limit exhausted for a minute (remaining 0, reset in 60 s);
- the installation suspended for 30 s, then restored;
- 1,000 forged or replayed deliveries: unsigned, signed with another secret, signed for another
  body, SHA-1 only, malformed signatures, and genuine deliveries sent again with their delivery id.

Then the faults stop, and the run waits (bounded by ``--timeout``) for every job to finish and for
the pool to settle at ``minIdle`` with one registration per VM. It stops by itself, kills every
process it started and deletes its namespaces and work directory.

    KUBEBUILDER_ASSETS=$(bash scripts/setup.sh) .venv/bin/python benchmarks/chaos.py
    KUBEBUILDER_ASSETS=$(bash scripts/setup.sh) .venv/bin/python benchmarks/chaos.py --quick

The defaults are the matrix above (24 jobs, a 300 s fault phase, bounded at 570 s); ``--quick``
is a smaller one (8 jobs, 100 s, 4 operator and 1 agent kill, rate limit 30 s, suspension 15 s,
300 forged deliveries, bounded at 300 s). Exit status 1 when a loss column is not 0.

Columns: ``jobs run`` (completed successfully), ``jobs lost`` (queued but not completed
successfully by the end), ``registrations leaked`` (runners at GitHub without a VM once settled),
``busy runners killed`` (runners whose job failed because the runner died, or whose VM was deleted
while GitHub showed it busy), ``secrets found`` (secret values in logs, Events and objects:
:mod:`impvm.devstack.leaks`), ``forged accepted`` (forged deliveries answered 2xx, replays answered
202), ``double mints`` (VMs with more than one successful generate-jitconfig call).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from lightkube.types import PatchType

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.leaks import Recorder, haystack, leaked
from impvm.devstack.seed import INSTALLATION_ID, NAMESPACE, ORG, POOL, REPO
from impvm.devstack.stack import Stack, wait_for
from impvm.kube.controlplane import free_port

MAX_CONCURRENT = 4
FAIL_5XX = 0.2
WEBHOOK_LOSS = 0.3
#: (jobs, fault phase s, operator kills, agent kills, rate limit s, suspension s, forged, bound s)
FULL = (24, 300, 10, 3, 60, 30, 1000, 570)
QUICK = (8, 100, 4, 1, 30, 15, 300, 300)
GITHUB_HEADERS = ("Content-Type", "X-GitHub-Event", "X-GitHub-Delivery", "X-Hub-Signature-256")


@dataclass
class Result:
    jobs: int = 0
    run: int = 0
    lost: int = 0
    leaked: int = 0
    busy_killed: int = 0
    secrets: list[tuple[str, str]] = field(default_factory=list)
    forged_sent: int = 0
    replayed: int = 0
    forged_accepted: int = 0
    double_mints: int = 0
    operator_kills: int = 0
    agent_kills: int = 0
    #: runners GitHub showed busy at each agent kill
    busy_at_agent_kills: list[int] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class Relay:
    """Stand-in -> operator: forwards each delivery to the first replica that answers (as a
    Service would) and keeps it for a replay."""

    ports: list[int]
    captured: list[tuple[int, bytes, dict[str, str]]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/webhooks/github", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}/webhooks/github"

    async def send(
        self, body: bytes, headers: dict[str, str], first: int | None = None
    ) -> tuple[int, int]:
        """POST to the replicas in turn (``first`` first); (port, status), status 0 when none
        answered."""
        ports = sorted(self.ports, key=lambda p: p != first)
        async with httpx.AsyncClient(timeout=10) as http:
            for port in ports:
                try:
                    r = await http.post(
                        f"http://127.0.0.1:{port}/webhooks/github", content=body, headers=headers
                    )
                except httpx.HTTPError:
                    continue
                return port, r.status_code
        return 0, 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {h: request.headers[h] for h in GITHUB_HEADERS if h in request.headers}
        port, status = await self.send(body, headers)
        if 200 <= status < 300:
            self.captured.append((port, body, headers))
        return web.Response(status=status or 502)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def forged(i: int, secret: str) -> tuple[bytes, dict[str, str]]:
    """The ``i``-th forged delivery: a queued job our pool would take, with a bad signature."""
    body = json.dumps(
        {
            "action": "queued",
            "workflow_job": {
                "id": 9_000_000 + i,
                "run_id": 8_000_000 + i,
                "name": "forged",
                "status": "queued",
                "labels": ["self-hosted", "imp"],
            },
            "repository": {"id": 1, "name": REPO.split("/")[1], "full_name": REPO},
            "organization": {"login": ORG},
        }
    ).encode()
    headers = {
        "Content-Type": "application/json",
        "X-GitHub-Event": "workflow_job",
        "X-GitHub-Delivery": str(uuid.uuid4()),
    }

    def sign(key: str, data: bytes) -> str:
        return "sha256=" + hmac.new(key.encode(), data, hashlib.sha256).hexdigest()

    kind = i % 5
    if kind == 1:
        headers["X-Hub-Signature-256"] = sign("not-the-secret", body)
    elif kind == 2:  # a signature of another body (a tampered delivery)
        headers["X-Hub-Signature-256"] = sign(secret, body + b" ")
    elif kind == 3:  # SHA-1 only (GitHub's legacy header)
        digest = hmac.new(secret.encode(), body, hashlib.sha1).hexdigest()
        headers["X-Hub-Signature"] = "sha1=" + digest
    elif kind == 4:
        headers["X-Hub-Signature-256"] = "sha256=" + "0" * 63 + "z"
    return body, headers


async def role(port: int) -> str:
    """``leader``, ``standby`` or ``down`` from a replica's /healthz."""
    try:
        async with httpx.AsyncClient(timeout=2) as h:
            r = await h.get(f"http://127.0.0.1:{port}/healthz")
    except httpx.HTTPError:
        return "down"
    return r.text.split()[-1] if r.status_code == 200 else "down"


async def control(stack: Stack, path: str, body: dict[str, Any]) -> None:
    assert stack.standin is not None
    async with httpx.AsyncClient(base_url=stack.standin.url, timeout=10) as http:
        (await http.post(path, json=body)).raise_for_status()


async def run(args: argparse.Namespace) -> Result:
    res = Result(jobs=args.jobs)
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    wd = Path(tempfile.mkdtemp(prefix="impvm-chaos-"))
    stack = Stack(
        StackConfig(
            workdir=wd / "stack",
            polling_interval_seconds=5,
            scaling_mode="hybrid",
            webhook_drop_rate=WEBHOOK_LOSS,
            runtime=args.runtime,
        )
    )
    port1 = free_port()
    relay: Relay | None = None
    try:
        await stack.start()
        assert stack.standin is not None and stack.kube is not None
        st = stack.standin.state
        st.runner_timeout = 10.0  # GitHub notices a dead runner after a while; here sooner
        ports = [stack.operator_http_port, port1]
        relay = Relay(ports)
        st.webhooks[0].url = await relay.start()
        await stack.kube.patch(
            ImpVMRunnerPoolResource,
            POOL,
            {
                "spec": {
                    "scaling": {
                        "maxConcurrent": MAX_CONCURRENT,
                        "scaleUpStep": MAX_CONCURRENT,
                        "cooldownSeconds": 10,
                    }
                }
            },
            namespace=NAMESPACE,
            patch_type=PatchType.MERGE,
        )
        stack.start_operator(replica=1, port=port1)
        names = {stack.operator_http_port: "operator", port1: "operator-1"}

        async def warm() -> bool:
            roles = {await role(p) for p in ports}
            return roles == {"leader", "standby"} and (await stack.pool_status()).get("idle") == 1

        await wait_for("two replicas and an idle runner", warm, 240, stack)
        print(f"stack up in {time.monotonic() - t0:.0f} s; faults for {args.fault_seconds} s")

        with Recorder(stack) as rec:
            ids: list[int] = []
            busy_killed: set[str] = set()
            stop = asyncio.Event()

            async def watch_busy() -> None:
                """VMs deleted while GitHub shows their runner busy."""
                while not stop.is_set():
                    with contextlib.suppress(Exception):
                        busy = {r.name for r in stack.runners() if r.busy}
                        for v in await stack.vms():
                            name = v["metadata"]["name"]
                            if v["metadata"].get("deletionTimestamp") and name in busy:
                                busy_killed.add(name)
                    await asyncio.sleep(0.5)

            async def queue() -> None:
                gap = args.fault_seconds * 0.8 / max(args.jobs, 1)
                for _ in range(args.jobs):
                    ids.extend(stack.queue_jobs(1, sleep=args.job_seconds))
                    await asyncio.sleep(gap)

            async def kill_operators() -> None:
                gap = args.fault_seconds / args.operator_kills
                start = time.monotonic()
                for k in range(args.operator_kills):
                    await asyncio.sleep(max(0.0, start + (k + 0.5) * gap - time.monotonic()))
                    leaders = [p for p in ports if await role(p) == "leader"]
                    port = leaders[0] if leaders else random.choice(ports)
                    stack.kill(names[port])  # SIGKILL to its session, waited for
                    if port == stack.operator_http_port:
                        stack.start_operator()
                    else:
                        stack.start_operator(replica=1, port=port1)
                    res.operator_kills += 1

            async def kill_agents() -> None:
                start = time.monotonic()
                for k in range(args.agent_kills):
                    at = start + (k + 1) * args.fault_seconds / (args.agent_kills + 1)
                    await asyncio.sleep(max(0.0, at - time.monotonic()))
                    # --kill-agent-when-busy: up to 30 s more for a runner in a job, so the
                    # kill meets one (re-attach is what is tested then)
                    if args.kill_agent_when_busy:
                        for _ in range(60):
                            if any(r.busy for r in stack.runners()):
                                break
                            await asyncio.sleep(0.5)
                    res.busy_at_agent_kills.append(sum(r.busy for r in stack.runners()))
                    stack.kill("agent-node-1")
                    stack.start_agent()
                    res.agent_kills += 1

            async def github_outages() -> None:
                await control(
                    stack,
                    "/_standin/failures",
                    {"kind": "status", "status": 502, "count": 10**9, "probability": FAIL_5XX},
                )
                await asyncio.sleep(args.fault_seconds * 0.2)
                await control(
                    stack,
                    "/_standin/rate-limit",
                    {"remaining": 0, "reset_in": args.rate_limit_seconds},
                )
                await asyncio.sleep(max(args.rate_limit_seconds, args.fault_seconds * 0.3))
                inst = f"/_standin/installations/{INSTALLATION_ID}"
                await control(stack, inst, {"suspended": True})
                await asyncio.sleep(args.suspend_seconds)
                await control(stack, inst, {"suspended": False})

            async def forge() -> None:
                assert relay is not None
                gap = args.fault_seconds * 0.9 / args.forged
                start = time.monotonic()
                replayed = 0
                for i in range(args.forged):
                    if replayed < len(relay.captured):  # a genuine delivery, sent again
                        port, body, headers = relay.captured[replayed]
                        replayed += 1
                        res.replayed += 1
                        _, status = await relay.send(body, headers, first=port)
                        accepted = status == 202
                    else:
                        body, headers = forged(i, stack.webhook_secret)
                        _, status = await relay.send(body, headers)
                        accepted = 200 <= status < 300
                    res.forged_sent += 1
                    if accepted:
                        res.forged_accepted += 1
                        res.notes.append(f"accepted {headers} -> {status}")
                    await asyncio.sleep(max(0.0, start + (i + 1) * gap - time.monotonic()))

            watcher = asyncio.create_task(watch_busy())
            faults = [
                queue(),
                kill_operators(),
                kill_agents(),
                github_outages(),
                forge(),
            ]
            try:
                await asyncio.wait_for(
                    asyncio.gather(*faults), max(deadline - time.monotonic() - 60, 1)
                )
            except TimeoutError:
                res.notes.append("the fault phase did not finish within --timeout")
            # the faults end: GitHub and the webhook path are healthy again
            await control(stack, f"/_standin/installations/{INSTALLATION_ID}", {"suspended": False})
            st.failures.clear()
            for b in st.buckets.values():
                b.remaining = b.limit
            st.webhooks[0].drop_rate = 0.0
            print(f"faults done at {time.monotonic() - t0:.0f} s; waiting for the jobs to finish")

            async def all_done() -> bool:
                return all(st.jobs[i].status == "completed" for i in ids)

            async def settled() -> bool:
                vms = {v["metadata"]["name"] for v in await stack.vms()}
                status = await stack.pool_status()
                return status.get("idle") == 1 and {r.name for r in stack.runners()} == vms

            for what, check in (("every job completed", all_done), ("the pool settled", settled)):
                try:
                    await wait_for(what, check, max(deadline - time.monotonic(), 1), stack)
                except TimeoutError as e:
                    res.notes.append(str(e))
            stop.set()
            await watcher

        jobs = [st.jobs[i] for i in ids]
        res.jobs = len(jobs)
        res.run = sum(1 for j in jobs if j.conclusion == "success")
        res.lost = res.jobs - res.run
        busy_killed |= {j.runner_name for j in jobs if j.conclusion == "failure" and j.runner_name}
        res.busy_killed = len(busy_killed)
        vms = {v["metadata"]["name"] for v in await stack.vms()}
        res.leaked = len({r.name for r in stack.runners()} - vms)
        mints = Counter(
            r.get("runner_name")
            for r in st.requests
            if r["path"].endswith("/generate-jitconfig") and r.get("status") == 201
        )
        res.double_mints = sum(1 for c in mints.values() if c > 1)
        res.secrets = leaked(rec.secrets(), await haystack(stack, ports))
        if not rec.jit_configs:
            res.notes.append("no JIT config was sampled: the secret search had nothing to find")
    finally:
        if relay is not None:
            await relay.stop()
        await stack.stop()
        shutil.rmtree(wd, ignore_errors=True)  # etcd's data holds the App key
    res.seconds = time.monotonic() - t0
    return res


def table(r: Result, args: argparse.Namespace) -> str:
    rows = [
        ("jobs run", f"{r.run} / {r.jobs}"),
        ("jobs lost", str(r.lost)),
        ("registrations leaked", str(r.leaked)),
        ("busy runners killed", str(r.busy_killed)),
        ("secrets found in logs/Events/objects", str(len(r.secrets))),
        (
            "forged deliveries accepted",
            f"{r.forged_accepted} / {r.forged_sent} ({r.replayed} of them replays)",
        ),
        ("VMs minted twice", str(r.double_mints)),
    ]
    out = ["| measure | value |", "| --- | ---: |"]
    out += [f"| {a} | {b} |" for a, b in rows]
    out.append(
        f"\n{r.operator_kills} operator kill -9, {r.agent_kills} agent kill -9 (busy runners "
        f"then: {', '.join(map(str, r.busy_at_agent_kills)) or '-'}), "
        f"{FAIL_5XX:.0%} GitHub 5xx, {WEBHOOK_LOSS:.0%} webhooks lost, rate limit exhausted "
        f"{args.rate_limit_seconds} s, installation suspended {args.suspend_seconds} s; "
        f"{r.seconds:.0f} s; {args.runtime} runtime"
    )
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's knobs; ``--quick`` sets the smaller preset (explicit flags still win)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help=f"the smaller preset: {QUICK}")
    names = (
        "jobs",
        "fault-seconds",
        "operator-kills",
        "agent-kills",
        "rate-limit-seconds",
        "suspend-seconds",
        "forged",
        "timeout",
    )
    for name, default in zip(names, FULL, strict=True):
        ap.add_argument(f"--{name}", type=int, help=f"default {default}")
    ap.add_argument("--job-seconds", type=float, default=3.0, help="each job's run time")
    ap.add_argument(
        "--kill-agent-when-busy",
        action="store_true",
        help="each agent kill waits (at most 30 s) until a runner is in a job",
    )
    ap.add_argument(
        "--runtime",
        choices=("process", "qemu"),
        default="process",
        help="the agent's runtime: qemu VMs outlive a killed agent and are re-attached; "
        "process sandboxes die with it (a busy one then loses its job)",
    )
    args = ap.parse_args(argv)
    for name, full, quick in zip(names, FULL, QUICK, strict=True):
        attr = name.replace("-", "_")
        if getattr(args, attr) is None:
            setattr(args, attr, quick if args.quick else full)
    return args


def main() -> int:
    args = parse()
    r = asyncio.run(run(args))
    print(table(r, args))
    for kind, where in r.secrets:
        print(f"secret found: {kind} in {where}")
    for n in r.notes[:20]:
        print("note:", n)
    losses = (r.lost, r.leaked, r.busy_killed, len(r.secrets), r.forged_accepted, r.double_mints)
    return 0 if not any(losses) else 1


if __name__ == "__main__":
    sys.exit(main())
