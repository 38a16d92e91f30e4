"""Reproducible tarballs: a tree written with sorted entries, fixed owners, normalised modes and
clamped mtimes (:func:`write_tree_tar`), mmdebstrap's tarball without device nodes
(:func:`drop_device_nodes`); a file's sha256. Raises :class:`ImageBuildError`."""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

from impvm.images.options import ImageBuildError

#: the read and write size of file copies and hashes
CHUNK = 1 << 20


def _norm_mode(mode: int, is_dir: bool) -> int:
    if is_dir or mode & 0o111:
        return 0o755
    return 0o644


def write_tree_tar(
    tree: Path,
    out: Path,
    epoch: int,
    owner: Callable[[str], tuple[int, int]] = lambda _p: (0, 0),
) -> int:
    """Write every entry below ``tree`` (not ``tree`` itself) to the uncompressed tarball
    ``out``: sorted by path, mtimes clamped to ``epoch``, modes normalised (directories and
    executables 0755, other files 0644), owner ``owner(path)`` (uid, gid), no user/group names.
    Returns the sum of the regular files' sizes in bytes. Hard links within the tree stay hard
    links; device nodes are refused (``ImageBuildError``)."""
    total = 0
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in _sorted_walk(tree):
            rel = path.relative_to(tree).as_posix()
            info = tar.gettarinfo(str(path), arcname=rel)
            if info.ischr() or info.isblk() or info.isfifo():
                raise ImageBuildError(f"{rel}: device nodes and FIFOs do not belong in a layer")
            info.uid, info.gid = owner(rel)
            info.uname = info.gname = ""
            info.mtime = min(int(info.mtime), epoch)
            if not info.issym():
                info.mode = _norm_mode(info.mode, info.isdir())
            if info.isreg():
                total += info.size
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return total


def _sorted_walk(tree: Path) -> Iterator[Path]:
    for entry in sorted(tree.iterdir(), key=lambda p: p.name):
        yield entry
        if entry.is_dir() and not entry.is_symlink():
            yield from _sorted_walk(entry)


def drop_device_nodes(src: Path, dst: Path) -> int:
    """Copy the tarball ``src`` to ``dst`` without character/block devices and FIFOs (mmdebstrap
    puts ``/dev`` nodes into its tarball; an OCI layer has none, the runtime provides ``/dev``).
    Order and headers are kept. Returns the sum of the regular files' sizes in bytes."""
    total = 0
    with tarfile.open(src) as inp, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as out:
        for m in inp:
            if m.ischr() or m.isblk() or m.isfifo():
                continue
            if m.isreg():
                total += m.size
                out.addfile(m, inp.extractfile(m))
            else:
                out.addfile(m)
    return total


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
