"""Accelerator choice of the ``qemu`` runtime, decided at agent start by a real tiny boot.

``/dev/kvm`` existing is not enough: nested KVM guests can hang (seen on the development host),
so :func:`detect_accelerator` boots the guest kernel + initramfs in probe mode (kernel argument
``imp.probe``: the guest init prints ``IMPVM-PROBE-OK <kernel version>`` and powers off) under
KVM with a timeout, and falls back to TCG (software emulation) when that does not finish. A TCG
probe that fails too raises :class:`AcceleratorError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Accel = Literal["kvm", "tcg"]
Machine = Literal["microvm", "q35"]
PROBE_MARKER = b"IMPVM-PROBE-OK"


class AcceleratorError(Exception):
    """Neither KVM nor TCG boots the guest (message: each attempt's reason)."""


@dataclass(frozen=True)
class AccelChoice:
    """The chosen accelerator and machine type, why (``reason``: one entry per attempt) and the
    probe boot time of the chosen pair in seconds (QEMU start → guest marker)."""

    accel: Accel
    machine: Machine
    reason: str
    boot_seconds: float

    def __str__(self) -> str:
        return f"{self.accel}/{self.machine}"


def host_tsc_khz() -> int | None:
    """The host CPU clock in kHz from ``/proc/cpuinfo`` (``cpu MHz``), or ``None``. Under TCG the
    guest TSC runs at the host TSC rate; a microvm guest has no PIT-independent timer to calibrate
    it against, and under host load the PIT calibration fails and the guest hangs, so the kernel
    is told the rate (``tsc_early_khz``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        return None
    return None


def kernel_args(accel: Accel, machine: Machine) -> list[str]:
    """Kernel command-line words the machine needs beyond the console (see
    :func:`host_tsc_khz`)."""
    if accel == "tcg" and machine == "microvm":
        khz = host_tsc_khz()
        if khz:
            return [f"tsc_early_khz={khz}", "tsc=reliable"]
    return []


def machine_args(accel: Accel, machine: Machine, vcpu: int, memory_mib: int) -> list[str]:
    """QEMU arguments for the machine: ``microvm`` (virtio-mmio devices, no PCI, qboot firmware)
    or ``q35`` (PCI, SeaBIOS); ``vcpu`` CPUs, ``memory_mib`` MiB; KVM with ``-cpu host``, TCG
    with QEMU's default CPU model. No display, no default devices, no reboot (a guest reboot ends
    QEMU)."""
    cpu = ["-cpu", "host"] if accel == "kvm" else []
    return [
        "-machine",
        machine,
        "-accel",
        accel,
        *cpu,
        "-smp",
        str(vcpu),
        "-m",
        str(memory_mib),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
    ]


def kvm_usable() -> str | None:
    """``None`` when ``/dev/kvm`` opens read-write, else the reason it does not."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/kvm: {exc.strerror}"
    os.close(fd)
    return None


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """preexec_fn: SIGKILL this process when its parent (the agent) dies (prctl(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


async def probe_boot(
    qemu: str,
    accel: Accel,
    machine: Machine,
    kernel: Path,
    initramfs: Path,
    timeout_seconds: float,
    extra_args: Sequence[str] = (),
) -> float:
    """Boot ``kernel`` + ``initramfs`` in probe mode under ``accel`` on ``machine`` (kernel
    arguments ``extra_args`` too, as the VMs get them); return seconds to the probe marker.
    Raises :class:`AcceleratorError` on timeout (QEMU is killed) or failure."""
    append = " ".join(
        ["console=ttyS0 panic=-1 loglevel=1 imp.probe", *kernel_args(accel, machine), *extra_args]
    )
    args = [
        qemu,
        *machine_args(accel, machine, 1, 256),
        "-kernel",
        str(kernel),
        "-initrd",
        str(initramfs),
        "-append",
        append,
        "-serial",
        "stdio",
    ]
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # a probe never outlives the agent that asked (VMs do)
    )
    assert proc.stdout is not None
    seen = b""
    try:
        async with asyncio.timeout(timeout_seconds):
            while PROBE_MARKER not in seen:
                chunk = await proc.stdout.read(4096)
                if not chunk:
                    break
                seen = (seen + chunk)[-8192:]
            took = time.monotonic() - t0
            await proc.wait()
    except TimeoutError:
        raise AcceleratorError(
            f"{accel}/{machine}: no boot within {timeout_seconds:.0f}s"
        ) from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if PROBE_MARKER not in seen:
        tail = seen.decode(errors="replace").strip().splitlines()[-3:]
        raise AcceleratorError(
            f"{accel}/{machine}: QEMU exited {proc.returncode}: {' | '.join(tail)}"
        )
    return took


async def detect_accelerator(
    qemu: str,
    kernel: Path,
    initramfs: Path,
    prefer: Literal["auto", "kvm", "tcg"] = "auto",
    kvm_timeout_seconds: float = 15.0,
    tcg_timeout_seconds: float = 45.0,
    extra_args: Sequence[str] = (),
) -> AccelChoice:
    """Choose the accelerator and machine by probe boots (kernel arguments ``extra_args``
    too), in order: KVM (only when ``/dev/kvm`` opens and ``prefer`` is not ``tcg``) then TCG
    (unless ``prefer="kvm"``); for each, the ``microvm`` machine then ``q35``. The first probe
    that reaches the guest marker within the timeout wins. Raises :class:`AcceleratorError`
    naming every failed attempt."""
    reasons: list[str] = []
    accels: list[Accel] = []
    if prefer in ("auto", "kvm"):
        why = kvm_usable()
        if why is None:
            accels.append("kvm")
        else:
            reasons.append(f"kvm: {why}")
    if prefer in ("auto", "tcg"):
        accels.append("tcg")
    machines: tuple[Machine, ...] = ("microvm", "q35")
    for accel in accels:
        timeout = kvm_timeout_seconds if accel == "kvm" else tcg_timeout_seconds
        for machine in machines:
            try:
                took = await probe_boot(
                    qemu, accel, machine, kernel, initramfs, timeout, extra_args
                )
            except AcceleratorError as exc:
                reasons.append(str(exc))
                continue
            reasons.append(f"{accel}/{machine}: probe boot in {took:.1f}s")
            return AccelChoice(accel, machine, "; ".join(reasons), took)
    raise AcceleratorError("; ".join(reasons) or "no accelerator allowed")
