"""Benchmark: time from a workflow_job ``queued`` webhook delivery to the ImpVM and its
JIT Secret existing, with 1 and with 20 pools, on the embedded stack (real control plane, operator
process, GitHub stand-in).

Baseline in the same run: the time this process takes to create an ImpVM and a Secret directly
through the API server (the floor any controller pays). Prints median and p99 of both and their
ratio.

    KUBEBUILDER_ASSETS=$(bash src/impvm/kube/assets/build-control-plane.sh) \\
        .venv/bin/python benchmarks/webhook_to_vm.py --samples 40
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret

from impvm.api.resources import ImpVMResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE, ORG, REPO
from impvm.devstack.stack import Stack, wait_for


def payload(job_id: int, labels: list[str]) -> bytes:
    return json.dumps(
        {
            "action": "queued",
            "workflow_job": {
                "id": job_id,
                "run_id": job_id + 1,
                "name": "build",
                "status": "queued",
                "labels": labels,
            },
            "repository": {
                "id": 1,
                "name": REPO.split("/")[1],
                "full_name": REPO,
                "owner": {"login": ORG},
            },
        }
    ).encode()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def measure(pools: int, samples: int) -> tuple[list[float], list[float]]:
    wd = Path(tempfile.mkdtemp(prefix="impvm-bench-"))
    s = Stack(
        StackConfig(workdir=wd, scaling_mode="webhook", start_agent=False, apply_example=True)
    )
    await s.start()
    try:
        assert s.kube is not None
        names = [f"bench-{i}" for i in range(pools)]
        for n in names:
            await s.add_pool(n, [n], min_idle=0, max_concurrent=samples + 1, scale_up_step=10)

        async def all_passed() -> bool:  # each pool registered its webhook secret
            return all(["observedGeneration" in await s.pool_status(n) for n in names])

        await wait_for("every pool's first pass", all_passed, 300, s)
        url = f"http://127.0.0.1:{s.operator_http_port}/webhooks/github"
        latencies: list[float] = []
        async with httpx.AsyncClient() as http:
            for i in range(samples):
                pool = names[i % pools]
                known = {
                    v["metadata"]["name"]
                    for v in await s.vms()
                    if v["metadata"]["labels"].get("imp.dev/runner-pool") == pool
                }
                body = payload(10_000 + i, ["self-hosted", pool])
                sig = (
                    "sha256="
                    + hmac.new(s.webhook_secret.encode(), body, hashlib.sha256).hexdigest()
                )
                t0 = time.perf_counter()
                r = await http.post(
                    url,
                    content=body,
                    headers={
                        "X-GitHub-Event": "workflow_job",
                        "X-GitHub-Delivery": str(uuid.uuid4()),
                        "X-Hub-Signature-256": sig,
                    },
                )
                assert r.status_code == 202, r.text
                async for _t, vm in s.kube.watch(
                    ImpVMResource, namespace=NAMESPACE, labels={"imp.dev/runner-pool": pool}
                ):
                    if vm["metadata"]["name"] not in known and vm["spec"].get("runnerConfigSecret"):
                        latencies.append(time.perf_counter() - t0)
                        break
        baseline: list[float] = []
        for i in range(samples):
            t0 = time.perf_counter()
            vm: Any = await s.kube.create(
                ImpVMResource.from_dict(
                    {
                        "metadata": {"name": f"baseline-{i}", "namespace": NAMESPACE},
                        "spec": {"classRef": {"name": "runner-class"}, "image": s.images.base},  # type: ignore[union-attr]
                    }
                )
            )
            await s.kube.create(
                Secret(
                    metadata=ObjectMeta(name=f"baseline-{i}-jit", namespace=NAMESPACE),
                    data={"jitconfig": base64.b64encode(b"x").decode()},
                )
            )
            del vm
            baseline.append(time.perf_counter() - t0)
        return latencies, baseline
    finally:
        await s.stop()
        shutil.rmtree(wd, ignore_errors=True)  # etcd's data holds the App key


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--pools", type=int, nargs="*", default=[1, 20])
    args = ap.parse_args()
    for pools in args.pools:
        lat, base = await measure(pools, args.samples)
        med, p99 = statistics.median(lat), pct(lat, 99)
        bmed, bp99 = statistics.median(base), pct(base, 99)
        print(
            f"pools={pools:2d} samples={len(lat)} webhook->VM+Secret: median {med * 1000:.0f} ms "
            f"p99 {p99 * 1000:.0f} ms | baseline direct create: median {bmed * 1000:.0f} ms "
            f"p99 {bp99 * 1000:.0f} ms | ratio median {med / bmed:.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
