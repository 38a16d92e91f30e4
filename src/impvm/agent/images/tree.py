"""File trees of the image cache (:mod:`impvm.agent.images`): their disk usage, made read-only,
removed although read-only. Blocking: callers run them in a worker thread."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path


def _tree_size(path: Path) -> int:
    """Disk usage (bytes, 512-byte blocks, hard links counted once) of a tree."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _make_readonly(path: Path) -> None:
    """Remove every write bit below ``path`` (files first, then directories); symlinks untouched."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files + dirs:
            p = os.path.join(root, name)
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode):
                os.chmod(p, stat.S_IMODE(st.st_mode) & ~0o222)
    st = os.lstat(path)
    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o222)


def _remove_tree(path: Path) -> None:
    """Delete a (possibly read-only) tree: give directories back their owner write bit first."""
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink():
        os.chmod(path, 0o700)
        for root, dirs, _files in os.walk(path):
            for name in dirs:
                p = os.path.join(root, name)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
    shutil.rmtree(path, ignore_errors=True)
