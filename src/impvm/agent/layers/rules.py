"""The rules every entry of an image layer is judged by before anything is written (pure): the
breakout rules of Docker's layer extraction plus no device nodes (:func:`entry_problem`), and
what an entry costs the image's size budget (:func:`entry_cost`, :class:`Budget`). The package
docstring of :mod:`impvm.agent.layers` says why."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from impvm.agent.runtime import ImageError

#: What every entry costs the budget beyond its data (an inode and a directory entry), bytes.
ENTRY_BYTES = 512
#: Data is charged in whole blocks of this many bytes (a directory one block).
BLOCK_BYTES = 4096


class ImageRefused(ImageError):
    """A layer holds an entry that breaks a rule of :func:`entry_problem`, or is no readable
    tar stream: the image is refused, nothing of it was written."""

    reason = "ImageRefused"


class ImageTooLarge(ImageError):
    """An image is bigger than the image cache's size cap (declared in its manifest, or found
    while its layers are read): refused before it fills the disk."""

    reason = "ImageTooLarge"


def _leaves_root(start: Sequence[str], path: str) -> bool:
    """Whether ``path`` (``/``-separated), walked lexically from the directory ``start`` (its
    components below the root), climbs above the root with ``..``."""
    depth = len(start)
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        else:
            depth += 1
    return False


def entry_problem(name: str, kind: str, linkname: str = "") -> str | None:
    """Why the tar entry ``name`` may not be unpacked, or None. ``kind``: ``file``, ``dir``,
    ``symlink``, ``hardlink``, ``chr``, ``blk``, ``fifo`` or ``other``; ``linkname``: a link's
    target. The rules (module docstring) are moby ``pkg/archive``'s breakout checks plus no
    device nodes."""
    if _leaves_root([], name):
        return "its path leaves the image root"
    if kind == "hardlink" and _leaves_root([], linkname):
        return f"it is a hard link to {linkname!r}, which leaves the image root"
    if kind == "symlink" and not linkname.startswith("/"):
        parent = [p for p in name.split("/") if p not in ("", ".")][:-1]
        if _leaves_root(parent, linkname):
            return f"it is a symlink to {linkname!r}, which leaves the image root"
    if kind in ("chr", "blk"):
        return "it is a device node (an image may not bring devices)"
    return None


def entry_cost(kind: str, size: int) -> int:
    """What an entry of ``kind`` with ``size`` data bytes costs the budget, in bytes."""
    if kind == "file":
        return ENTRY_BYTES + -(-size // BLOCK_BYTES) * BLOCK_BYTES
    if kind == "dir":
        return ENTRY_BYTES + BLOCK_BYTES
    return ENTRY_BYTES


@dataclass
class Budget:
    """Bytes an image may take once unpacked: ``limit`` in total, ``used`` so far."""

    limit: int
    used: int = 0

    def charge(self, cost: int, what: str) -> None:
        """Add ``cost`` bytes; raise :class:`ImageTooLarge` naming ``what`` when over."""
        self.used += cost
        if self.used > self.limit:
            raise ImageTooLarge(
                f"{what} unpacks to more than the image cache's size cap of "
                f"{_mib(self.limit)}; refused before it was written"
            )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
