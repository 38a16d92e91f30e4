"""The guest kernel's PVH boot image (:mod:`impvm.agent.qemu_guest`): its ELF ``vmlinux`` taken
out of the bzImage (:func:`extract_vmlinux`: the setup header's payload, decompressed) when it
carries the Xen ``PHYS32_ENTRY`` note, built once per kernel and cached (:func:`pvh_image`)."""

from __future__ import annotations

import asyncio
import bz2
import ctypes
import ctypes.util
import hashlib
import lzma
import os
import struct
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from impvm.agent.qemu_guest.boot import GuestAssetError
from impvm.agent.qemu_guest.kernel import Kernel

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
