"""The tar walker: a layer decompressed as a stream and its tar headers read one by one without
extracting anything (bounded reads, forward-only seeks), every entry judged by
:mod:`impvm.agent.layers.rules` and charged to the image's budget (:func:`scan_layer`,
:func:`check_layers`)."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

from impvm.agent.layers.rules import Budget, ImageRefused, entry_cost, entry_problem

#: The largest single read of a layer's tar stream (a PAX or GNU long-name header), bytes.
MAX_HEADER_BYTES = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _kind(info: tarfile.TarInfo) -> str:
    if info.islnk():
        return "hardlink"
    if info.issym():
        return "symlink"
    if info.isdir():
        return "dir"
    if info.ischr():
        return "chr"
    if info.isblk():
        return "blk"
    if info.isfifo():
        return "fifo"
    return "file" if info.isreg() else "other"


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


class _TarStream(io.RawIOBase):
    """The uncompressed bytes of a layer as a forward-only seekable file for ``tarfile``:
    skipping data reads and drops it; a read larger than :data:`MAX_HEADER_BYTES` is refused."""

    def __init__(self, src: _Readable) -> None:
        super().__init__()
        self._src = src
        self._pos = 0
        #: what the last read returned (the block that ended the archive, once it ended)
        self.last = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0 or size > MAX_HEADER_BYTES:
            raise tarfile.HeaderError(f"a tar header of more than {MAX_HEADER_BYTES} bytes")
        data = self._src.read(size)
        self._pos += len(data)
        self.last = data
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset if whence == io.SEEK_SET else self._pos + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self._pos:
            raise io.UnsupportedOperation("a layer stream only seeks forward")
        while self._pos < target:
            chunk = self._src.read(min(1 << 20, target - self._pos))
            if not chunk:
                break
            self._pos += len(chunk)
        return self._pos


def _open_layer(raw: IO[bytes], what: str) -> _Readable:
    magic = raw.read(4)
    raw.seek(0)
    if magic.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if magic == _ZSTD_MAGIC:
        raise ImageRefused(f"{what} is zstd-compressed, which umoci cannot unpack")
    return raw


def _parts(name: str) -> tuple[str, ...]:
    return tuple(p for p in name.split("/") if p not in ("", "."))


def scan_layer(blob: Path, budget: Budget, what: str, *, through_links: bool = True) -> int:
    """Read layer ``blob`` (a tar, plain or gzip) entry by entry without extracting it: every
    entry must pass :func:`entry_problem` and :meth:`Budget.charge`; with ``through_links``
    False no entry may lie below a symlink the same archive made (for an extractor that does
    not resolve paths inside its root, such as ``tarfile``). Returns the number of entries.
    Raises :class:`ImageRefused` (naming ``what`` and the entry) or :class:`ImageTooLarge`
    (blocking; run in a thread)."""
    entries = 0
    links: set[tuple[str, ...]] = set()
    with blob.open("rb") as raw:
        src = _open_layer(raw, what)
        stream = _TarStream(src)
        try:
            tar = tarfile.TarFile(fileobj=stream, mode="r")
            while (info := tar.next()) is not None:
                # headers only (never extracted): memory stays flat for any entry count
                cast(Any, tar).members.clear()
                entries += 1
                kind = _kind(info)
                problem = entry_problem(info.name, kind, info.linkname)
                parts = _parts(info.name)
                if not through_links:
                    if any(parts[:i] in links for i in range(1, len(parts))):
                        problem = "it lies below a symlink of the same archive"
                    if kind == "symlink":
                        links.add(parts)
                if problem is not None:
                    raise ImageRefused(f"{what}: entry {info.name!r} is refused: {problem}")
                budget.charge(entry_cost(kind, info.size), what)
            # tarfile ends at the first header it cannot read, where umoci's reader (Go's
            # archive/tar) may read on: the archive must end in zero blocks only, so both
            # readers see the same entries
            while stream.last:
                if stream.last.count(0) != len(stream.last):
                    at = stream.tell() - len(stream.last)
                    raise ImageRefused(
                        f"{what}: data after the end of its tar archive (near byte {at}): "
                        "refused, it may hide entries"
                    )
                budget.charge(len(stream.last), what)
                stream.read(MAX_HEADER_BYTES)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ImageRefused(f"{what} is not a readable tar stream: {exc}") from None
    return entries


@dataclass(frozen=True)
class LayerBlob:
    """A layer in an OCI layout: its blob's ``path``, ``digest`` and whose it is (``what``:
    e.g. ``runner layer REF``)."""

    path: Path
    digest: str
    what: str


def check_layers(layers: Iterable[LayerBlob], limit: int) -> int:
    """Scan every layer in order against one budget of ``limit`` bytes (the image cache's cap);
    returns the bytes charged. Raises :class:`ImageRefused` or :class:`ImageTooLarge`."""
    budget = Budget(limit)
    for layer in layers:
        scan_layer(layer.path, budget, f"{layer.what} (layer {layer.digest[:19]})")
    return budget.used
