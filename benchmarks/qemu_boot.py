"""Boot-to-runner-start time of the ``qemu`` runtime, with the ``process`` runtime as the
baseline in the same run.

Measures, N times (default 5) per runtime, the seconds from ``Runtime.start`` (QEMU launched) to
the guest init's ``runner-start`` report (:meth:`Runtime.inspect` status ``running``), on the
busybox test image with a runner layer whose run.sh exits 0 at once. Prints each sample, the
median and the ratio qemu/process. The accelerator is probed as the agent does
(``--accelerator tcg`` forces TCG).

    .venv/bin/python benchmarks/qemu_boot.py [--runs 5] [--accelerator auto|kvm|tcg]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.agent.qemu import create_qemu_runtime
from impvm.agent.runtime import Runtime, Secret, VMRequest
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.testimages import build_base_image, build_runner_layer_image


async def _sample(rt: Runtime, req: VMRequest) -> float:
    await rt.prepare(req)
    t0 = time.monotonic()
    await rt.start(req, Secret("bench-jit"))
    while True:
        st = await rt.inspect(req)
        if st.status in ("running", "exited"):
            took = time.monotonic() - t0
            break
        await asyncio.sleep(0.02)
    await rt.stop(req, grace_seconds=30)
    await rt.cleanup(req)
    return took


async def main(runs: int, accelerator: str) -> None:
    with tempfile.TemporaryDirectory(prefix="qemu-boot-") as d:
        work = Path(d)
        async with LocalRegistry() as reg:
            base = await build_base_image(work / "base", reg.address)
            layer = await build_runner_layer_image(
                work / "layer", reg.address, run_sh="#!/bin/sh\nexit 0\n", tag="bench"
            )
            store = ImageStore(work / "cache", 1 << 30, {reg.address})
            qemu = await create_qemu_runtime(store, work / "qemu", accelerator=accelerator)  # type: ignore[arg-type]
            print(f"qemu: kernel {qemu.kernel.path}, {qemu.accel} ({qemu.accel.reason})")
            results: dict[str, list[float]] = {}
            for rt in (ProcessRuntime(store), qemu):
                samples = []
                for i in range(runs):
                    req = VMRequest(
                        vm_id=f"bench.{rt.name}-{i}.0",
                        name=f"bench-{i}",
                        namespace="bench",
                        image=base,
                        runner_layer=layer,
                        allow_unpinned_images=False,
                        vcpu=1,
                        memory_mib=512,
                        disk_gib=10,
                        workdir=work / "vms" / f"{rt.name}-{i}",
                    )
                    samples.append(await _sample(rt, req))
                results[rt.name] = samples
                print(
                    f"{rt.name}: boot-to-runner-start median {statistics.median(samples):.2f}s "
                    f"over {runs} runs: " + " ".join(f"{s:.2f}" for s in samples)
                )
            ratio = statistics.median(results["qemu"]) / statistics.median(results["process"])
            print(f"ratio qemu/process (median): {ratio:.1f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--accelerator", default="auto", choices=["auto", "kvm", "tcg"])
    args = ap.parse_args()
    asyncio.run(main(args.runs, args.accelerator))
