"""Guest boot assets of the ``qemu`` runtime: the kernel and the guest initramfs.

Kernel: a Debian kernel image (``/boot/vmlinuz-<version>``, package ``linux-image-amd64``) with its
modules in ``/lib/modules/<version>``. The agent is configured with one (``--qemu-kernel``); by
default :func:`find_kernel` takes the newest ``/boot/vmlinuz-*`` whose modules include 9p (needed
for read-only host shares; Debian's ``linux-image-cloud-amd64`` lacks ``CONFIG_NET_9P`` and works
only without shares).

Initramfs (uncompressed ``newc`` cpio, written by :func:`build_initramfs`, cached by content):

* ``/bin/busybox`` (Debian ``busybox-static``) with one symlink per applet;
* ``/init``: the guest init (``impvm/agent/assets/guest/init``, see its header);
* ``/lib/modules/<path>.ko`` for :data:`GUEST_MODULES` and their dependencies (from the kernel's
  ``modules.dep``; built-in ones from ``modules.builtin`` are skipped) and ``/etc/imp/modules``,
  the load order (dependencies first).

It holds nothing per VM and nothing secret; per-VM data arrives through fw_cfg at launch.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import stat
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

#: Modules the guest init needs (virtio transports, disks, net, 9p shares, overlay root, fw_cfg).
GUEST_MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_net",
    "crc32c_generic",
    "ext4",
    "overlay",
    "9pnet_virtio",
    "9p",
    "qemu_fw_cfg",
)
_SHARE_MODULES = ("9p", "9pnet_virtio")


class GuestAssetError(Exception):
    """No usable kernel, or the initramfs could not be built."""


@dataclass(frozen=True)
class Kernel:
    """A guest kernel: ``path`` (the bzImage), ``version`` (``uname -r``), ``modules`` (its
    ``/lib/modules/<version>`` directory)."""

    path: Path
    version: str
    modules: Path

    def has_module(self, name: str) -> bool:
        """Whether ``name`` is a loadable module or built in."""
        return name in _module_index(self.modules)[0] or name in _builtin(self.modules)


def _modname(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    base = re.sub(r"\.ko(\.(xz|gz|zst))?$", "", base)
    return base.replace("-", "_")


def _module_index(moddir: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``(name -> relative path, relative path -> dependency paths)`` from ``modules.dep``."""
    paths: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    try:
        text = (moddir / "modules.dep").read_text()
    except OSError:
        return paths, deps
    for line in text.splitlines():
        mod, _, rest = line.partition(":")
        if not mod:
            continue
        paths[_modname(mod)] = mod
        deps[mod] = rest.split()
    return paths, deps


def _builtin(moddir: Path) -> set[str]:
    try:
        return {_modname(ln) for ln in (moddir / "modules.builtin").read_text().splitlines()}
    except OSError:
        return set()


def find_kernel(path: Path | None = None, need_shares: bool = True) -> Kernel:
    """The kernel at ``path`` or, when ``None``, the newest ``/boot/vmlinuz-*`` with modules (one
    with 9p modules when ``need_shares``). The version is the file name's suffix after
    ``vmlinuz-``. Raises :class:`GuestAssetError` when none fits (the message names the Debian
    package to install)."""
    candidates = [path] if path else sorted(Path("/boot").glob("vmlinuz-*"), reverse=True)
    problems: list[str] = []
    for cand in candidates:
        version = cand.name.removeprefix("vmlinuz-")
        k = Kernel(cand, version, Path("/lib/modules") / version)
        if not cand.is_file() or not os.access(cand, os.R_OK):
            problems.append(f"{cand}: not a readable file")
            continue
        if not (k.modules / "modules.dep").is_file():
            problems.append(f"{cand}: no {k.modules}/modules.dep")
            continue
        missing = [m for m in GUEST_MODULES if m not in _SHARE_MODULES and not k.has_module(m)]
        if need_shares:
            missing += [m for m in _SHARE_MODULES if not k.has_module(m)]
        if missing:
            problems.append(f"{cand}: lacks modules {', '.join(missing)}")
            continue
        return k
    detail = "; ".join(problems) or "no /boot/vmlinuz-*"
    raise GuestAssetError(f"no usable guest kernel ({detail})")


def module_order(kernel: Kernel, names: tuple[str, ...] = GUEST_MODULES) -> list[str]:
    """Relative module paths to ``insmod`` in order (dependencies first, each once); names that
    are built in or unknown are skipped."""
    paths, deps = _module_index(kernel.modules)
    order: list[str] = []

    def visit(rel: str) -> None:
        if rel in order:
            return
        for d in deps.get(rel, []):
            visit(d)
        order.append(rel)

    for n in names:
        if n in paths:
            visit(paths[n])
    return order


def init_script() -> bytes:
    """The guest ``/init`` (``impvm/agent/assets/guest/init``)."""
    return resources.files("impvm.agent").joinpath("assets/guest/init").read_bytes()


class _Cpio:
    """A minimal writer of the ``newc`` cpio format (the one the kernel unpacks)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.ino = 1

    def add(self, name: str, mode: int, data: bytes = b"") -> None:
        nlink = 2 if stat.S_ISDIR(mode) else 1
        fields = [self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
        self.ino += 1
        head = b"070701" + b"".join(f"{v:08X}".encode() for v in fields)
        self._pad(head + name.encode() + b"\0")
        self._pad(data)

    def _pad(self, b: bytes) -> None:
        self.parts.append(b)
        n = sum(len(p) for p in self.parts)
        if n % 4:
            self.parts.append(b"\0" * (4 - n % 4))

    def finish(self) -> bytes:
        self.add("TRAILER!!!", 0)
        return b"".join(self.parts)


def _initramfs_bytes(kernel: Kernel, busybox: Path, applets: list[str]) -> bytes:
    order = module_order(kernel)
    cpio = _Cpio()
    dirs = {"bin", "sbin", "dev", "proc", "sys", "etc", "etc/imp", "mnt", "newroot", "lib"}
    for rel in order:
        parts = Path("lib/modules", rel).parent.parts
        dirs |= {"/".join(parts[: i + 1]) for i in range(len(parts))}
    for d in sorted(dirs, key=lambda p: (p.count("/"), p)):
        cpio.add(d, stat.S_IFDIR | 0o755)
    cpio.add("dev/console", stat.S_IFCHR | 0o600)  # placeholder; devtmpfs replaces /dev
    cpio.add("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes())
    for a in applets:
        if a != "busybox" and "/" not in a:
            cpio.add(f"bin/{a}", stat.S_IFLNK | 0o777, b"busybox")
    cpio.add("init", stat.S_IFREG | 0o755, init_script())
    for rel in order:
        cpio.add(f"lib/modules/{rel}", stat.S_IFREG | 0o644, (kernel.modules / rel).read_bytes())
    cpio.add("etc/imp/modules", stat.S_IFREG | 0o644, "".join(f"{r}\n" for r in order).encode())
    return cpio.finish()


async def build_initramfs(
    kernel: Kernel, cache_dir: Path, busybox: Path = Path("/bin/busybox")
) -> Path:
    """Build (or reuse) the guest initramfs for ``kernel`` under ``cache_dir``; returns its path
    (``initramfs-<sha256 prefix>.cpio``, mode 0644, read only by QEMU). The key covers the init
    script, busybox, the kernel version and the module list. Raises :class:`GuestAssetError`
    when busybox or a module cannot be read."""
    if not await asyncio.to_thread(busybox.is_file):
        raise GuestAssetError(f"{busybox} missing (Debian package busybox-static)")
    proc = await asyncio.create_subprocess_exec(
        str(busybox),
        "--list",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    applets = sorted(out.decode().split())
    st = await asyncio.to_thread(busybox.stat)
    h = hashlib.sha256()
    for part in (init_script(), kernel.version.encode(), str(module_order(kernel)).encode()):
        h.update(part + b"\0")
    h.update(f"{st.st_size}:{st.st_mtime_ns}:{applets}".encode())
    dest = cache_dir / f"initramfs-{h.hexdigest()[:16]}.cpio"
    if await asyncio.to_thread(dest.is_file):
        return dest
    try:
        await asyncio.to_thread(cache_dir.mkdir, parents=True, exist_ok=True)
        data = await asyncio.to_thread(_initramfs_bytes, kernel, busybox, applets)
        tmp = cache_dir / f".{dest.name}.{uuid.uuid4().hex}"
        await asyncio.to_thread(tmp.write_bytes, data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except OSError as exc:
        raise GuestAssetError(f"building the guest initramfs failed: {exc}") from exc
    return dest
