"""Setting the ``qemu`` runtime up at agent start (:mod:`impvm.agent.qemu`): the guest kernel, its
PVH image and the initramfs (:mod:`impvm.agent.qemu_guest`), and the accelerator and machine a
real probe boot chose (:mod:`impvm.agent.qemu_accel`), kept per machine boot and set of
binaries so a restarted agent is back within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

from impvm.agent.images import ImageStore
from impvm.agent.network.node import NodeNetwork
from impvm.agent.qemu.runtime import QemuRuntime
from impvm.agent.qemu_accel import AccelChoice, AcceleratorError, detect_accelerator
from impvm.agent.qemu_guest import (
    GuestAssetError,
    GuestBoot,
    Kernel,
    build_initramfs,
    find_kernel,
    pvh_image,
)
from impvm.agent.runtime import VMRuntimeError

log = logging.getLogger("impvm.agent.qemu")


async def create_qemu_runtime(
    store: ImageStore,
    state_dir: Path,
    *,
    kernel: Path | None = None,
    accelerator: Literal["auto", "kvm", "tcg"] = "auto",
    extra_ro_binds: Sequence[Path] = (),
    auth_file: Path | None = None,
    qemu: str = "qemu-system-x86_64",
    network: NodeNetwork | None = None,
    guest: GuestBoot | None = None,
) -> QemuRuntime:
    """Set up the ``qemu`` runtime at agent start: find the kernel (``kernel`` or the newest
    usable ``/boot/vmlinuz-*``), take out its PVH image and build/reuse the guest initramfs
    under ``state_dir`` (``guest``: how the guest boots, default :class:`GuestBoot`), probe the
    accelerator and machine with real boots - once per machine boot and set of binaries: a
    restarted agent (an upgrade, a crash) reuses the choice, so it is back within seconds,
    before its Lease expires and its running VMs count as lost. A PVH image that boots on no
    machine is dropped for the bzImage. Raises :class:`VMRuntimeError` when QEMU is missing or
    nothing boots (the message names each attempt)."""
    if shutil.which(qemu) is None:
        raise VMRuntimeError(f"{qemu} not found (Debian package qemu-system-x86)")
    guest = guest or GuestBoot()
    try:
        k = find_kernel(kernel, need_shares=any(p.is_dir() for p in extra_ro_binds))
        if guest.pvh:
            k, why = await pvh_image(k, state_dir / "guest")
            if why:
                log.info("guest kernel boots from its bzImage: %s", why)
        initramfs = await build_initramfs(
            k,
            state_dir / "guest",
            init=guest.init,
            applets=guest.applets,
            unsigned_modules=guest.unsigned_modules,
        )
        choice = await _choose_accelerator(qemu, k, initramfs, accelerator, guest, state_dir)
        if choice is None:  # the PVH image booted nowhere: the bzImage
            log.warning("guest kernel %s does not boot at its PVH entry; bzImage", k.path)
            k = replace(k, pvh=None)
            choice = await _choose_accelerator(qemu, k, initramfs, accelerator, guest, state_dir)
        if choice is None:  # not reached: a bzImage that boots nowhere raises
            raise AcceleratorError(f"{k.path} boots on no machine")
    except (GuestAssetError, AcceleratorError) as exc:
        raise VMRuntimeError(str(exc)) from None
    return QemuRuntime(
        store,
        kernel=k,
        initramfs=initramfs,
        accel=choice,
        state_dir=state_dir,
        extra_ro_binds=extra_ro_binds,
        auth_file=auth_file,
        qemu=qemu,
        network=network,
        boot_args=guest.kernel_args,
    )


async def _choose_accelerator(
    qemu: str,
    kernel: Kernel,
    initramfs: Path,
    accelerator: Literal["auto", "kvm", "tcg"],
    guest: GuestBoot,
    state_dir: Path,
) -> AccelChoice | None:
    """The probed accelerator and machine for booting ``kernel.boot_image`` (cached in
    ``state_dir/accelerator.json`` per machine boot and set of binaries); ``None`` when a PVH
    image boots nowhere (the caller retries with the bzImage). Raises
    :class:`AcceleratorError` when a bzImage boots nowhere."""
    image = kernel.boot_image
    key = _probe_key(qemu, image, initramfs, f"{accelerator} {' '.join(guest.kernel_args)}")
    cache = state_dir / "accelerator.json"
    choice = await asyncio.to_thread(_cached_choice, cache, key)
    if choice is None:
        try:
            choice = await detect_accelerator(
                qemu, image, initramfs, prefer=accelerator, extra_args=guest.kernel_args
            )
        except AcceleratorError:
            if kernel.pvh is None:
                raise
            return None
        await asyncio.to_thread(_write_choice, cache, key, choice)
    return choice


def _probe_key(qemu: str, kernel: Path, initramfs: Path, prefer: str) -> str:
    """What an accelerator probe depends on: the machine's boot, the QEMU binary, the kernel, the
    initramfs and the preference."""
    parts: list[str] = [prefer]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    for f in (shutil.which(qemu) or qemu, kernel, initramfs):
        try:
            st = os.stat(f)
            parts.append(f"{os.path.realpath(f)}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(str(f))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _cached_choice(cache: Path, key: str) -> AccelChoice | None:
    try:
        rec = json.loads(cache.read_text())
        if rec.get("key") != key:
            return None
        return AccelChoice(
            accel=rec["accel"],
            machine=rec["machine"],
            reason=f"{rec['reason']}; probed earlier this boot",
            boot_seconds=float(rec["boot_seconds"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_choice(cache: Path, key: str, choice: AccelChoice) -> None:
    rec = {
        "key": key,
        "accel": choice.accel,
        "machine": choice.machine,
        "reason": choice.reason,
        "boot_seconds": choice.boot_seconds,
    }
    tmp = cache.with_name(f".{cache.name}.tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, cache)
