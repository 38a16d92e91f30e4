"""``impvm agent``: one node agent with its runtime."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

from lightkube import AsyncClient

from impvm.agent.agent import Agent, AgentConfig
from impvm.agent.capacity import Resources
from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.agent.qemu import QemuRuntime, create_qemu_runtime
from impvm.agent.runtime import Runtime

log = logging.getLogger("impvm.agent")


def default_node_name() -> str:
    """``NODE_NAME`` (set from the downward API in a DaemonSet), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def host_memory_mib() -> int:
    """Total memory of this host in MiB (from /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def make_runtime(
    name: str,
    workdir: Path,
    image_cache_bytes: int,
    insecure_registries: set[str],
    ro_binds: list[Path],
    qemu_kernel: Path | None = None,
    qemu_accelerator: str = "auto",
    cosign: str = "cosign",
) -> Runtime:
    """The runtime called ``name``: ``process`` (bubblewrap) or ``qemu`` (a VM per job; finds the
    kernel, builds the guest initramfs and probes the accelerator with real boots, which takes
    seconds). ``qemu_accelerator``: ``auto``, ``kvm`` or ``tcg``. Raises ``ValueError`` for an
    unknown or unavailable runtime (the message says why). ``cosign``: the binary verifying
    signed images (run only for VMs whose spec has ``verify``)."""
    store = ImageStore(workdir / "images", image_cache_bytes, insecure_registries, cosign)
    if name == "process":
        return ProcessRuntime(store, extra_ro_binds=ro_binds)
    if name == "qemu":
        if qemu_accelerator not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accelerator {qemu_accelerator!r}: want auto, kvm or tcg")
        from impvm.agent.runtime import RuntimeError_

        try:
            rt = asyncio.run(
                create_qemu_runtime(
                    store,
                    workdir / "qemu",
                    kernel=qemu_kernel,
                    accelerator=qemu_accelerator,  # type: ignore[arg-type]
                    extra_ro_binds=ro_binds,
                )
            )
        except RuntimeError_ as exc:
            raise ValueError(f"runtime 'qemu' is not available: {exc}") from None
        log.info(
            "qemu runtime: kernel %s, accelerator %s (%s)",
            rt.kernel.path,
            rt.accel,
            rt.accel.reason,
        )
        return rt
    raise ValueError(f"runtime {name!r} is not available (known: process, qemu)")


async def run(config: AgentConfig, runtime: Runtime) -> None:
    """Run the agent until cancelled (credentials from KUBECONFIG or the ServiceAccount)."""
    kube = AsyncClient(field_manager="impvm-agent")
    try:
        await Agent(kube, runtime, config).run()
    finally:
        await kube.close()


def main(
    node_name: str,
    runtime_name: str,
    vcpu: int,
    memory_mib: int,
    workdir: Path,
    image_cache_mib: int,
    insecure_registries: list[str],
    ro_binds: list[Path],
    lease_namespace: str,
    qemu_kernel: Path | None = None,
    qemu_accelerator: str = "auto",
    cosign: str = "cosign",
) -> None:
    """Blocking entry point of the CLI."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    runtime = make_runtime(
        runtime_name,
        workdir,
        image_cache_mib * 1024 * 1024,
        set(insecure_registries),
        ro_binds,
        qemu_kernel,
        qemu_accelerator,
        cosign,
    )
    config = AgentConfig(
        node_name=node_name,
        capacity=Resources(vcpu, memory_mib),
        workdir=workdir,
        lease_namespace=lease_namespace,
        accelerator=str(runtime.accel) if isinstance(runtime, QemuRuntime) else "none",
    )
    asyncio.run(run(config, runtime))
