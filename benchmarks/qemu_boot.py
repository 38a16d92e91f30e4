"""Boot-to-runner-start time of the ``qemu`` runtime: the agent's guest boot against the boot
before its trims (``baseline``), measured back to back in the same run, with the ``process``
runtime as a floor.

The baseline boots the bzImage (no PVH entry), with no extra kernel arguments, an initramfs with
every busybox applet and the guest init as it was before (``benchmarks/baseline/guest-init``);
the agent's boot is :class:`impvm.agent.qemu_guest.GuestBoot`'s default. Both share the kernel,
QEMU, the machine and the accelerator (probed once, as the agent does; ``--accelerator tcg``
forces TCG).

Each round boots one VM per configuration (the order alternates between rounds, so neither
always runs first) on the busybox test image with a runner layer whose run.sh exits 0 at once,
and records, from ``Runtime.start`` (the scratch disk is made, QEMU launched):

* ``init``: seconds until the guest init's first report on the status port (``IMPVM-STATUS
  boot``): QEMU, firmware and the kernel;
* ``runner``: seconds until its ``runner-start`` report (:meth:`Runtime.inspect` ``running``):
  the figure;
* ``cpu``: QEMU's CPU seconds until then (``utime + stime``), steadier than wall-clock time on a
  shared machine: under TCG the boot is the vCPU thread's work.

Prints each sample, the medians and the ratio agent/baseline.

    .venv/bin/python benchmarks/qemu_boot.py [--runs 5] [--accelerator auto|kvm|tcg]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.agent.qemu import QemuRuntime, create_qemu_runtime, read_record
from impvm.agent.qemu_guest import GuestBoot
from impvm.agent.runtime import Runtime, Secret, VMRequest
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.testimages import build_base_image, build_runner_layer_image

HERE = Path(__file__).resolve().parent
#: The guest boot before the trims: bzImage, no extra kernel arguments, every applet, old init.
BASELINE = GuestBoot(
    pvh=False,
    kernel_args=(),
    init=(HERE / "baseline" / "guest-init").read_bytes(),
    applets=None,
)


def _cpu_seconds(workdir: Path) -> float:
    rec = read_record(workdir)
    if rec is None:
        return float("nan")
    try:
        stat = Path(f"/proc/{int(rec['pid'])}/stat").read_text()
    except OSError:
        return float("nan")
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _sample(rt: Runtime, req: VMRequest) -> tuple[float, float, float]:
    """``(init, runner, cpu)`` of one boot (see the module docstring)."""
    await rt.prepare(req)
    t0 = time.monotonic()
    await rt.start(req, Secret("bench-jit"))
    init = float("nan")
    status = req.workdir / "status.log"
    deadline = t0 + 300
    while True:
        now = time.monotonic()
        if init != init and status.is_file() and b"boot" in status.read_bytes():
            init = now - t0
        st = await rt.inspect(req)
        if st.status in ("running", "exited"):
            took = time.monotonic() - t0
            break
        if now > deadline:
            raise SystemExit(f"{req.vm_id}: no runner start within 300 s:\n{st.log_tail}")
        await asyncio.sleep(0.01)
    cpu = _cpu_seconds(req.workdir) if isinstance(rt, QemuRuntime) else 0.0
    if st.status == "exited" and isinstance(rt, QemuRuntime):
        raise SystemExit(f"{req.vm_id}: exited {st.exit_code} before its runner started")
    await rt.stop(req, grace_seconds=30)
    await rt.cleanup(req)
    return (init if isinstance(rt, QemuRuntime) else 0.0), took, cpu


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


async def main(runs: int, accelerator: str) -> None:
    with tempfile.TemporaryDirectory(prefix="qemu-boot-") as d:
        work = Path(d)
        async with LocalRegistry() as reg:
            base = await build_base_image(work / "base", reg.address)
            layer = await build_runner_layer_image(
                work / "layer", reg.address, run_sh="#!/bin/sh\nexit 0\n", tag="bench"
            )
            store = ImageStore(work / "cache", 1 << 30, {reg.address})
            agent = await create_qemu_runtime(store, work / "qemu", accelerator=accelerator)  # type: ignore[arg-type]
            before = await create_qemu_runtime(
                store,
                work / "qemu-baseline",
                accelerator=accelerator,  # type: ignore[arg-type]
                guest=BASELINE,
            )
            print(
                f"qemu: kernel {agent.kernel.path}, {agent.accel} ({agent.accel.reason}); "
                f"boots {agent.kernel.boot_image.name} with {' '.join(agent.boot_args)}"
            )
            print(f"baseline: boots {before.kernel.boot_image.name}, {before.accel}")
            runtimes: dict[str, Runtime] = {
                "process": ProcessRuntime(store),
                "baseline": before,
                "qemu": agent,
            }
            results: dict[str, list[tuple[float, float, float]]] = {n: [] for n in runtimes}
            for i in range(runs):
                order = ["process", "baseline", "qemu"] if i % 2 == 0 else ["qemu", "baseline"]
                for name in order if i % 2 == 0 else [*order, "process"]:
                    rt = runtimes[name]
                    req = VMRequest(
                        vm_id=f"bench.{name}-{i}.0",
                        name=f"bench-{i}",
                        namespace="bench",
                        image=base,
                        runner_layer=layer,
                        allow_unpinned_images=False,
                        vcpu=1,
                        memory_mib=512,
                        disk_gib=10,
                        workdir=work / "vms" / f"{name}-{i}",
                    )
                    results[name].append(await _sample(rt, req))
            for name, samples in results.items():
                init = [s[0] for s in samples]
                took = [s[1] for s in samples]
                cpu = [s[2] for s in samples]
                print(
                    f"{name}: boot-to-runner-start median {_med(took):.2f}s over {runs} runs: "
                    + " ".join(f"{s:.2f}" for s in took)
                )
                if name != "process":
                    print(
                        f"{name}: to init median {_med(init):.2f}s, init to runner start "
                        f"{_med(took) - _med(init):.2f}s, QEMU CPU median {_med(cpu):.2f}s: "
                        + " ".join(f"{s:.2f}" for s in cpu)
                    )
            med = {n: _med([s[1] for s in v]) for n, v in results.items()}
            cpu_med = {n: _med([s[2] for s in v]) for n, v in results.items() if n != "process"}
            print(f"ratio qemu/baseline (median): {med['qemu'] / med['baseline']:.2f}x")
            print(f"ratio qemu/baseline (QEMU CPU): {cpu_med['qemu'] / cpu_med['baseline']:.2f}x")
            print(f"ratio qemu/process (median): {med['qemu'] / max(med['process'], 1e-3):.1f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--accelerator", default="auto", choices=["auto", "kvm", "tcg"])
    args = ap.parse_args()
    asyncio.run(main(args.runs, args.accelerator))
