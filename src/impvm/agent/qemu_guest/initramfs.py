"""The guest initramfs (:mod:`impvm.agent.qemu_guest`): busybox and its applets, the ``/init``
script, the guest modules (without their signatures when the kernel allows it) and their load
order, as an uncompressed ``newc`` cpio cached by content (:func:`build_initramfs`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import struct
import uuid
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from impvm.agent.qemu_guest.boot import GUEST_APPLETS, GuestAssetError
from impvm.agent.qemu_guest.kernel import Kernel, module_order, pci_only_modules

_SIG_MAGIC = b"~Module signature appended~\n"


def module_signatures_required(kernel: Kernel) -> bool:
    """Whether ``kernel`` refuses unsigned modules: ``CONFIG_MODULE_SIG_FORCE=y`` in its
    ``config-<version>`` beside the image, or no such file (then assumed)."""
    cfg = kernel.path.parent / f"config-{kernel.version}"
    try:
        text = cfg.read_text(errors="replace")
    except OSError:
        return True
    return "\nCONFIG_MODULE_SIG_FORCE=y" in f"\n{text}"


def unsigned_module(ko: bytes) -> bytes:
    """``ko`` without the signature ``sign-file`` appends (the signature, a 12-byte
    ``struct module_signature`` ending in its big-endian length, then the magic string;
    module-signing.rst); unchanged when it has none."""
    if not ko.endswith(_SIG_MAGIC) or len(ko) < len(_SIG_MAGIC) + 12:
        return ko
    (sig_len,) = struct.unpack_from(">I", ko, len(ko) - len(_SIG_MAGIC) - 4)
    end = len(ko) - len(_SIG_MAGIC) - 12 - sig_len
    return ko[:end] if end > 0 else ko


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


def _initramfs_bytes(
    kernel: Kernel, busybox: Path, applets: list[str], init: bytes, unsigned: bool
) -> bytes:
    order = module_order(kernel)
    cpio = _Cpio()
    dirs = {"bin", "sbin", "dev", "proc", "sys", "etc", "etc/imp", "mnt", "newroot", "lib"}
    dirs |= {"mnt/lower", "mnt/scratch"}
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
    cpio.add("init", stat.S_IFREG | 0o755, init)
    for rel in order:
        ko = (kernel.modules / rel).read_bytes()
        data = unsigned_module(ko) if unsigned else ko
        cpio.add(f"lib/modules/{rel}", stat.S_IFREG | 0o644, data)
    cpio.add("etc/imp/modules", stat.S_IFREG | 0o644, "".join(f"{r}\n" for r in order).encode())
    pci = "".join(f"{r}\n" for r in pci_only_modules(kernel)).encode()
    cpio.add("etc/imp/modules-pci", stat.S_IFREG | 0o644, pci)
    return cpio.finish()


async def build_initramfs(
    kernel: Kernel,
    cache_dir: Path,
    busybox: Path = Path("/bin/busybox"),
    *,
    init: bytes | None = None,
    applets: Sequence[str] | None = GUEST_APPLETS,
    unsigned_modules: bool = True,
) -> Path:
    """Build (or reuse) the guest initramfs for ``kernel`` under ``cache_dir``; returns its path
    (``initramfs-<sha256 prefix>.cpio``, mode 0644, read only by QEMU). ``init``: the ``/init``
    script (default :func:`init_script`); ``applets``: the busybox applets to link (``None``:
    all); ``unsigned_modules``: drop module signatures unless the kernel requires them
    (:func:`module_signatures_required`). The key covers all of these, busybox, the kernel
    version and the module list. Raises :class:`GuestAssetError` when busybox or a module
    cannot be read, or busybox lacks an applet."""
    init = init_script() if init is None else init
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
    available = sorted(out.decode().split())
    if applets is None:
        links = available
    else:
        missing = sorted(set(applets) - set(available))
        if missing:
            raise GuestAssetError(f"{busybox} lacks the applets {', '.join(missing)}")
        links = sorted(applets)
    st = await asyncio.to_thread(busybox.stat)
    h = hashlib.sha256()
    for part in (init, kernel.version.encode(), str(module_order(kernel)).encode()):
        h.update(part + b"\0")
    unsigned = unsigned_modules and not module_signatures_required(kernel)
    h.update(f"{st.st_size}:{st.st_mtime_ns}:{links}:{unsigned}".encode())
    dest = cache_dir / f"initramfs-{h.hexdigest()[:16]}.cpio"
    if await asyncio.to_thread(dest.is_file):
        return dest
    try:
        await asyncio.to_thread(cache_dir.mkdir, parents=True, exist_ok=True)
        data = await asyncio.to_thread(_initramfs_bytes, kernel, busybox, links, init, unsigned)
        tmp = cache_dir / f".{dest.name}.{uuid.uuid4().hex}"
        await asyncio.to_thread(tmp.write_bytes, data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except OSError as exc:
        raise GuestAssetError(f"building the guest initramfs failed: {exc}") from exc
    return dest
