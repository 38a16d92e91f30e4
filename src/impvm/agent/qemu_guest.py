"""Guest boot assets of the ``qemu`` runtime: the kernel and the guest initramfs.

Kernel: a Debian kernel image (``/boot/vmlinuz-<version>``, package ``linux-image-amd64``) with its
modules in ``/lib/modules/<version>``. The agent is configured with one (``--qemu-kernel``); by
default :func:`find_kernel` takes the newest ``/boot/vmlinuz-*`` whose modules include 9p (needed
for read-only host shares; Debian's ``linux-image-cloud-amd64`` lacks ``CONFIG_NET_9P`` and works
only without shares).

Boot image: the kernel's own ELF ``vmlinux`` taken out of the bzImage (:func:`pvh_image`), so
QEMU starts it at its PVH entry point (the Xen ``PHYS32_ENTRY`` ELF note Debian's kernels carry,
``CONFIG_PVH``; QEMU's x86 loader takes such an ELF for ``-kernel``) and the guest skips the
bzImage's real-mode setup and decompressor: under TCG, unpacking 53-66 MB of kernel took about
0.5 s of every boot. A kernel without the note boots from its bzImage. PVH entry bypasses the
decompressor's KASLR, so the guest kernel runs at its link address: that only spares the job
itself work in attacking its own guest kernel, and root in a single-use VM gives it nothing the
VM boundary does not already confine.

Kernel command line (:data:`FAST_BOOT_ARGS`): no crypto self-tests, no IO-APIC timer check, lock
prefixes left in place.

Initramfs (uncompressed ``newc`` cpio, written by :func:`build_initramfs`, cached by content):

* ``/bin/busybox`` (Debian ``busybox-static``) with a symlink for each applet the init runs
  (:data:`GUEST_APPLETS`; every applet on request: the kernel unpacks each entry at every boot);
* ``/init``: the guest init (``impvm/agent/assets/guest/init``, see its header);
* ``/lib/modules/<path>.ko`` for :data:`GUEST_MODULES` and their dependencies (from the kernel's
  ``modules.dep``; built-in ones from ``modules.builtin`` are skipped) without their appended
  signatures when the kernel does not require them (``CONFIG_MODULE_SIG_FORCE`` unset in its
  ``/boot/config-<version>``): the guest would check, for every module at every boot, an RSA
  signature of a file the agent itself put there - under TCG a good part of loading a module -
  and loads an unsigned one all the same (taint flag ``E``); ``/etc/imp/modules``, the
  load order (dependencies first), and ``/etc/imp/modules-pci``, the ones only a machine with a
  PCI bus needs (q35; microvm has none, its init skips them).

It holds nothing per VM and nothing secret; per-VM data arrives through the config channel at
launch (:mod:`impvm.agent.guest_io`), never through fw_cfg.
"""

from __future__ import annotations

import asyncio
import bz2
import ctypes
import ctypes.util
import hashlib
import lzma
import os
import re
import stat
import struct
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

#: Modules the guest init needs (virtio transports, disks, net, the config channel's
#: virtio-serial port, 9p shares, overlay root).
GUEST_MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_net",
    "virtio_console",
    "crc32c_generic",
    "ext4",
    "overlay",
    "9pnet_virtio",
    "9p",
)
_SHARE_MODULES = ("9p", "9pnet_virtio")
#: Modules only a machine with a PCI bus needs (the init skips them when there is none).
_PCI_MODULES = ("virtio_pci",)

#: The busybox applets the guest init runs (the initramfs links only these).
GUEST_APPLETS = (
    "chmod",
    "chroot",
    "env",
    "grep",
    "insmod",
    "ip",
    "kill",
    "ln",
    "mkdir",
    "mount",
    "poweroff",
    "reboot",
    "rmmod",
    "sed",
    "sh",
    "sleep",
    "stty",
    "sync",
    "umount",
    "uname",
)

#: Kernel arguments that shorten the guest's boot (kernel-parameters.rst): no crypto self-tests at
#: algorithm registration (``cryptomgr.notests``; FIPS mode ignores it; they were 70 % of the
#: instruction-counted time to ``/init``, QEMU ``-icount``), no check that the timer interrupt
#: arrives through the IO-APIC (``no_timer_check``: a busy-wait of 10 ticks; QEMU delivers it),
#: and lock prefixes left in place on a one-CPU guest (``noreplace-smp``: patching out thousands
#: of them one by one flushed QEMU's TLB 35,000 times per boot; an uncontended lock prefix costs
#: next to nothing).
FAST_BOOT_ARGS = ("cryptomgr.notests", "no_timer_check", "noreplace-smp")


class GuestAssetError(Exception):
    """No usable kernel, or the initramfs could not be built."""


@dataclass(frozen=True)
class Kernel:
    """A guest kernel: ``path`` (the bzImage), ``version`` (``uname -r``), ``modules`` (its
    ``/lib/modules/<version>`` directory), ``pvh`` (its ELF image with a PVH entry point,
    :func:`pvh_image`; ``None``: QEMU boots the bzImage)."""

    path: Path
    version: str
    modules: Path
    pvh: Path | None = None

    @property
    def boot_image(self) -> Path:
        """What QEMU's ``-kernel`` loads: the PVH image when there is one, else the bzImage."""
        return self.pvh or self.path

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


def find_kernel(
    path: Path | None = None, need_shares: bool = True, modules_root: Path = Path("/lib/modules")
) -> Kernel:
    """The kernel at ``path`` or, when ``None``, the newest ``/boot/vmlinuz-*`` with modules (one
    with 9p modules when ``need_shares``). The version is the file name's suffix after
    ``vmlinuz-``. Raises :class:`GuestAssetError` when none fits (the message names the Debian
    package to install)."""
    candidates = [path] if path else sorted(Path("/boot").glob("vmlinuz-*"), reverse=True)
    problems: list[str] = []
    for cand in candidates:
        version = cand.name.removeprefix("vmlinuz-")
        k = Kernel(cand, version, modules_root / version)
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


def pci_only_modules(kernel: Kernel) -> list[str]:
    """Relative module paths that only the PCI transport needs (``virtio_pci`` and the
    dependencies no other guest module has)."""
    others = set(module_order(kernel, tuple(m for m in GUEST_MODULES if m not in _PCI_MODULES)))
    return [m for m in module_order(kernel, _PCI_MODULES) if m not in others]


@dataclass(frozen=True)
class GuestBoot:
    """How the guest boots: ``pvh`` (boot the kernel's ELF image at its PVH entry,
    :func:`pvh_image`), ``kernel_args`` (beyond console and panic; :data:`FAST_BOOT_ARGS`),
    ``init`` (the ``/init`` script; ``None``: the packaged one), ``applets`` (busybox applets
    linked in the initramfs; ``None``: all), ``unsigned_modules`` (modules without their
    signatures when the kernel allows it). The defaults are the agent's; the boot benchmark
    also boots the configuration before these trims."""

    pvh: bool = True
    kernel_args: tuple[str, ...] = FAST_BOOT_ARGS
    init: bytes | None = None
    applets: tuple[str, ...] | None = field(default=GUEST_APPLETS)
    unsigned_modules: bool = True


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


_XEN_ELFNOTE_PHYS32_ENTRY = 18
_LZ4_LEGACY_BLOCK = 8 << 20


def _bzimage_payload(bz: bytes) -> bytes:
    """The compressed kernel inside a bzImage: ``payload_offset``/``payload_length`` of the setup
    header (x86 boot protocol 2.08+, Documentation/arch/x86/boot.rst), counted from the
    protected-mode code at ``(setup_sects + 1) * 512``. Raises :class:`ValueError`."""
    if len(bz) < 0x250 or bz[0x202:0x206] != b"HdrS":
        raise ValueError("not a bzImage")
    if struct.unpack_from("<H", bz, 0x206)[0] < 0x208:
        raise ValueError("boot protocol before 2.08 (no payload fields)")
    setup_sects = bz[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bz, 0x248)
    start = (setup_sects + 1) * 512 + offset
    if start + length > len(bz):
        raise ValueError("payload beyond the end of the file")
    return bz[start : start + length]


def _unlz4_legacy(data: bytes) -> bytes:
    """LZ4's legacy frame (magic 0x184C2102, then blocks of <= 8 MiB each after its 4-byte
    size; the kernel build appends the uncompressed size), decoded with Debian's ``liblz4``
    (``LZ4_decompress_safe``). Raises :class:`ValueError`."""
    name = ctypes.util.find_library("lz4") or "liblz4.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise ValueError(f"liblz4 missing (Debian package liblz4-1): {exc}") from None
    fn = lib.LZ4_decompress_safe
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    out: list[bytes] = []
    dst = ctypes.create_string_buffer(_LZ4_LEGACY_BLOCK)
    pos = 4
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        if size == 0x184C2102 or pos + 4 + size > len(data):  # a new frame or the size trailer
            break
        n = fn(data[pos + 4 : pos + 4 + size], dst, size, _LZ4_LEGACY_BLOCK)
        if n < 0:
            raise ValueError("corrupt LZ4 block")
        out.append(dst.raw[:n])
        pos += 4 + size
    return b"".join(out)


def _stream(make: Callable[[], Any]) -> Callable[[bytes], bytes]:
    """A decoder that stops at the end of the first stream (the kernel build may append its
    size)."""
    return lambda data: bytes(make().decompress(data))


#: Compressions of Debian's kernels and how to undo them (by the payload's magic).
_DECODERS: tuple[tuple[bytes, str, Callable[[bytes], bytes]], ...] = (
    (b"\x1f\x8b", "gzip", _stream(lambda: zlib.decompressobj(wbits=31))),
    (b"\xfd7zXZ\x00", "xz", _stream(lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ))),
    (b"\x5d\x00\x00", "lzma", _stream(lambda: lzma.LZMADecompressor(lzma.FORMAT_ALONE))),
    (b"BZh", "bzip2", _stream(bz2.BZ2Decompressor)),
    (b"\x02\x21\x4c\x18", "lz4", _unlz4_legacy),
)


def _segments(elf: bytes) -> Iterator[tuple[int, int, int]]:
    """``(p_type, p_offset, p_filesz)`` of each program header of a 64-bit little-endian ELF
    (raises ``struct.error`` when the headers lie outside ``elf``)."""
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack_from(
            "<IIQQQQ", elf, phoff + i * phentsize
        )
        yield p_type, p_offset, p_filesz


def _usable_image(elf: bytes) -> bool:
    """A whole ELF image with a PVH entry: every segment inside the file (a cached image cut
    short, by a full disk or a crash, is built again instead of failing every probe boot)."""
    try:
        return _has_pvh_note(elf) and all(o + n <= len(elf) for _t, o, n in _segments(elf))
    except struct.error:
        return False


def _has_pvh_note(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF has the Xen ``PHYS32_ENTRY`` note (its PVH entry point)
    in a ``PT_NOTE`` segment."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return False
    for p_type, p_offset, p_filesz in _segments(elf):
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz]
            if name.rstrip(b"\0") == b"Xen" and ntype == _XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            pos += 12 + (namesz + 3) // 4 * 4 + (descsz + 3) // 4 * 4
    return False


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The kernel's ELF image inside ``bzimage`` when it can boot at a PVH entry point. Raises
    :class:`ValueError` naming why not (not a bzImage, a compression not handled here, no PVH
    note)."""
    payload = _bzimage_payload(bzimage)
    for magic, name, decode in _DECODERS:
        if payload.startswith(magic):
            try:
                elf = decode(payload)
            except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
                raise ValueError(f"{name} payload does not decompress: {exc}") from None
            break
    else:
        raise ValueError(f"payload compression unknown (magic {payload[:4].hex()})")
    if not _has_pvh_note(elf):
        raise ValueError("the kernel has no PVH entry point (CONFIG_PVH)")
    return elf


def _write_durably(path: Path, data: bytes) -> None:
    """``data`` into ``path`` (0644), on disk before it is renamed into place."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o644)


async def pvh_image(kernel: Kernel, cache_dir: Path) -> tuple[Kernel, str | None]:
    """``kernel`` with its PVH image (:func:`extract_vmlinux`), built once under ``cache_dir``
    (``vmlinux-<sha256 prefix of the bzImage>``, 0644) and reused; or ``kernel`` unchanged and
    the reason when it cannot boot that way (it then boots from its bzImage). Raises
    :class:`GuestAssetError` when the kernel cannot be read or the image not written."""
    try:
        bz = await asyncio.to_thread(kernel.path.read_bytes)
    except OSError as exc:
        raise GuestAssetError(f"reading the guest kernel failed: {exc}") from exc
    dest = cache_dir / f"vmlinux-{hashlib.sha256(bz).hexdigest()[:16]}"
    if await asyncio.to_thread(dest.is_file):
        try:
            cached = await asyncio.to_thread(dest.read_bytes)
        except OSError:
            cached = b""
        if _usable_image(cached):
            return replace(kernel, pvh=dest), None
    try:
        elf = await asyncio.to_thread(extract_vmlinux, bz)
    except ValueError as exc:
        return kernel, f"{kernel.path}: {exc}"
    try:
        await asyncio.to_thread(cache_dir.mkdir, parents=True, exist_ok=True)
        tmp = cache_dir / f".{dest.name}.{uuid.uuid4().hex}"
        await asyncio.to_thread(_write_durably, tmp, elf)
        os.replace(tmp, dest)
    except OSError as exc:
        raise GuestAssetError(f"writing the guest kernel's PVH image failed: {exc}") from exc
    return replace(kernel, pvh=dest), None


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
