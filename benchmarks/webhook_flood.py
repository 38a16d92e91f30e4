"""Benchmark: the memory and Lease of a real operator process under a flood of large and
forged webhook deliveries.

A real control plane, the GitHub stand-in and ``impvm operator`` (leader election on, the
default 15 s Lease) with ``--pools`` webhook-mode pools sharing one webhook secret. After the
pools had their first passes, ``--clients`` concurrent clients send ``--rounds`` rounds of: a
24 MB body with ``Content-Length``, a 24 MB chunked body, a 1 MiB body (under the limit) and a
26 MB body, all with a forged signature. Reported:

* the operator's RSS (``VmRSS`` of ``/proc/<pid>/status``, sampled every 0.1 s) before the flood
  (the baseline), its peak during the flood and the ratio;
* the longest time between two renewals of the leader Lease seen during the flood (the leader
  gives up 10 s after its last renewal), and whether the Lease kept its holder;
* the answers by status, and the wall time of the flood.

Bounded and loopback only: the stand-in and the operator listen on 127.0.0.1, every wait has a
deadline, everything the run started is stopped and its directory removed. The last line is
``FLOOD {json}``.

    KUBEBUILDER_ASSETS=$(bash scripts/setup.sh) .venv/bin/python benchmarks/webhook_flood.py
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.api.models import AGENT_LEASE_NAMESPACE, WEBHOOK_SECRET_KEY
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.devstack.seed import (
    APP_ID,
    INSTALLATION_ID,
    app_secret,
    make_private_key,
    pool_manifest,
    random_webhook_secret,
    seed_github,
)
from impvm.devstack.standin import StandIn
from impvm.kube.admin import admin_client, install_crds
from impvm.kube.controlplane import ControlPlane, free_port

NS = "flood"
BIG = 24 * 1024**2
IMAGE = "registry.example/imp/runner-base@sha256:" + "1" * 64


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def setup(kube: AsyncClient, key: str, secret: str, pools: int) -> None:
    await kube.create(Namespace(metadata=ObjectMeta(name=NS)))
    await kube.create(Namespace(metadata=ObjectMeta(name=AGENT_LEASE_NAMESPACE)))
    await kube.create(
        ImpVMClassResource.from_dict(
            {
                "apiVersion": "imp.dev/v1alpha1",
                "kind": "ImpVMClass",
                "metadata": {"name": "small"},
                "spec": {"vcpu": 1, "memoryMiB": 512, "diskGiB": 1},
            }
        )
    )
    await kube.create(
        ImpVMTemplateResource.from_dict(
            {
                "apiVersion": "imp.dev/v1alpha1",
                "kind": "ImpVMTemplate",
                "metadata": {"name": "runner", "namespace": NS},
                "spec": {"classRef": {"name": "small"}, "image": IMAGE, "runnerLayer": IMAGE},
            }
        )
    )
    await kube.create(app_secret("app", NS, APP_ID, INSTALLATION_ID, key))
    hook = base64.b64encode(secret.encode()).decode()
    await kube.create(
        Secret(metadata=ObjectMeta(name="hook", namespace=NS), data={WEBHOOK_SECRET_KEY: hook})
    )
    scaling = {
        "mode": "webhook",
        "minIdle": 0,
        "maxConcurrent": 1,
        "scaleUpStep": 1,
        "cooldownSeconds": 0,
        "webhook": {"secretRef": {"name": "hook"}},
    }
    for i in range(pools):
        body = pool_manifest(f"p{i}", NS, scaling, template="runner", credentials_secret="app")
        await kube.create(ImpVMRunnerPoolResource.from_dict(body))


async def wait_passes(kube: AsyncClient, pools: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        done = 0
        async for p in kube.list(ImpVMRunnerPoolResource, namespace=NS):
            if (p.to_dict().get("status") or {}).get("observedGeneration"):
                done += 1
        if done == pools:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError("the pools had no first pass in time")


def start_operator(kubeconfig: Path, log: Path, github: str, port: int) -> subprocess.Popen[bytes]:
    """``impvm operator`` for the benchmark's namespace, its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                str(Path(sys.executable).with_name("impvm")),
                "operator",
                "--namespace",
                NS,
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(port),
                "--github-api-url",
                github,
                "--advertise-url",
                f"http://127.0.0.1:{port}",
            ],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="impvm-flood-"))
    cp = ControlPlane(workdir=work / "cp").start()
    standin = StandIn()
    op: subprocess.Popen[bytes] | None = None
    try:
        install_crds(admin_client(cp.kubeconfig))
        kube = AsyncClient(config=KubeConfig.from_file(str(cp.kubeconfig)))
        await standin.start()
        key = make_private_key()
        seed_github(standin, key)
        secret = random_webhook_secret()
        await setup(kube, key, secret, args.pools)
        port = free_port()
        op = start_operator(cp.kubeconfig, work / "operator.log", standin.url, port)
        deadline = time.monotonic() + args.timeout
        await wait_passes(kube, args.pools, deadline)
        await asyncio.sleep(args.settle)
        baseline = rss_mib(op.pid)
        lease = await kube.get(Lease, "impvm-operator", namespace=AGENT_LEASE_NAMESPACE)
        assert lease.spec is not None
        holder = lease.spec.holderIdentity
        samples: list[float] = []
        renewals: list[float] = []
        holders: set[str | None] = {holder}
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set() and op is not None and op.poll() is None:
                samples.append(rss_mib(op.pid))
                await asyncio.sleep(0.1)

        async def renewed() -> None:
            # every renewal arrives as a watch event, however late this loop reads it
            async for _, got in kube.watch(
                Lease,
                namespace=AGENT_LEASE_NAMESPACE,
                fields={"metadata.name": "impvm-operator"},
                resource_version=lease.metadata.resourceVersion if lease.metadata else None,
            ):
                if got.spec is not None:
                    holders.add(got.spec.holderIdentity)
                    if got.spec.renewTime is not None:
                        renewals.append(got.spec.renewTime.timestamp())

        big = b"x" * BIG
        forged = {"X-GitHub-Event": "workflow_job", "X-Hub-Signature-256": "sha256=" + "0" * 64}
        answers: collections.Counter[str] = collections.Counter()
        slots = asyncio.Semaphore(args.clients)
        url = f"http://127.0.0.1:{port}/webhooks/github"

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(BIG // 65536):
                yield big[:65536]

        async def send(content: Any) -> None:
            async with slots, httpx.AsyncClient(timeout=300) as h:
                try:
                    r = await h.post(url, content=content, headers=forged)
                    answers[str(r.status_code)] += 1
                except httpx.TransportError as e:
                    answers[type(e).__name__] += 1

        sampler = asyncio.create_task(sample())
        watcher = asyncio.create_task(renewed())
        t0 = time.monotonic()
        sends = []
        for _ in range(args.rounds):
            sends += [send(big), send(chunked()), send(b"x" * 1024**2)]
            sends += [send(b"x" * (26 * 1024**2))]
        await asyncio.gather(*sends)
        took = time.monotonic() - t0
        await asyncio.sleep(5)
        done.set()
        await sampler
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        gaps = [b - a for a, b in itertools.pairwise(renewals)]
        alive = op.poll() is None
        await kube.close()
        return {
            "pools": args.pools,
            "clients": args.clients,
            "requests": len(sends),
            "flood_seconds": round(took, 1),
            "rss_baseline_mib": round(baseline, 1),
            "rss_peak_mib": round(max(samples, default=0.0), 1),
            "rss_peak_ratio": round(max(samples, default=0.0) / baseline, 2) if baseline else 0,
            "longest_renewal_gap_seconds": round(max(gaps, default=0.0), 2),
            "lease_kept_holder": holders == {holder},
            "leader_alive": alive,
            "answers": dict(answers),
        }
    finally:
        if op is not None and op.poll() is None:
            op.send_signal(signal.SIGTERM)
            try:
                op.wait(timeout=30)
            except subprocess.TimeoutExpired:
                op.kill()
        await standin.stop()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools", type=int, default=50)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--settle", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    out = asyncio.run(run(args))
    for k, v in out.items():
        print(f"{k}: {v}")
    print("FLOOD " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
