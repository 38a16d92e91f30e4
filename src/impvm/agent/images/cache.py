"""The image cache's entries and their size cap (:mod:`impvm.agent.images`): the cache key of an
(image, runner layer) pair, a prepared entry as read back from disk, the artifacts a runtime
derives from an entry, and least-recently-used eviction above the cap, sparing entries a running
VM retains."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from impvm.agent.images.tree import _remove_tree
from impvm.agent.runtime import ImageError

_INFO = "impvm.json"
_DERIVED = "derived"


class EvictedError(ImageError):
    """A cache entry was evicted while it was being used for more than one step: prepare it
    again."""


@dataclass(frozen=True)
class PreparedImage:
    """A prepared (unpacked, layered, read-only) image.

    ``rootfs``: the directory to use as the guest's ``/`` (never write to it); ``key``: the cache
    key of the (image digest, runner-layer digest) pair; ``image_digest``/``layer_digest``: the
    verified manifest digests; ``size_bytes``: disk usage of the entry in bytes (its tree and
    the artifacts derived from it); ``verified_by``: fingerprint (``sha256:<hex>``) of the key
    whose signatures cosign checked when pulling, None when the entry was pulled without a
    signature requirement.
    """

    rootfs: Path
    key: str
    image_digest: str
    layer_digest: str | None
    size_bytes: int
    verified_by: str | None = None


def cache_key(image_digest: str, layer_digest: str | None, trust: str | None = None) -> str:
    """The cache key of a pair: hex sha256 of ``"<image digest>\\n<layer digest or ->"``, with
    ``"\\n<trust>"`` appended when the entry is verified (``trust``: the key fingerprint and
    the repositories, see :meth:`ImageStore.prepare`)."""
    text = f"{image_digest}\n{layer_digest or '-'}" + (f"\n{trust}" if trust else "")
    return hashlib.sha256(text.encode()).hexdigest()


class ImageCache:
    """The entries under ``cache_dir/images/<key>`` (``cache_dir`` created 0700; ``tmp`` beside
    them for builds and evictions) and their cap of ``max_bytes``; what
    :class:`~impvm.agent.images.store.ImageStore` keeps its prepared images in."""

    def __init__(self, cache_dir: Path, max_bytes: int) -> None:
        self.cache_dir = cache_dir
        self.max_bytes = max_bytes
        self._images = cache_dir / "images"
        self._tmp = cache_dir / "tmp"
        self._locks: dict[str, asyncio.Lock] = {}
        self._evict_lock = asyncio.Lock()
        self._retained: dict[str, int] = {}
        for d in (cache_dir, self._images, self._tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(cache_dir, 0o700)

    def retain(self, key: str) -> None:
        """Mark an entry as in use (by a VM): :meth:`evict` skips it until :meth:`release`."""
        self._retained[key] = self._retained.get(key, 0) + 1

    def release(self, key: str) -> None:
        """Undo one :meth:`retain`."""
        n = self._retained.get(key, 0) - 1
        if n > 0:
            self._retained[key] = n
        else:
            self._retained.pop(key, None)

    def entry(self, key: str) -> PreparedImage | None:
        """The complete cache entry ``key`` (blocking), None when it is missing or evicted."""
        try:
            return self._load(key)
        except (OSError, ValueError, KeyError):
            return None

    def entries(self) -> list[PreparedImage]:
        """All complete cache entries, least recently used first."""
        found: list[tuple[float, PreparedImage]] = []
        for d in self._images.iterdir():
            with contextlib.suppress(OSError, ValueError, KeyError):
                found.append((d.stat().st_mtime, self._load(d.name)))
        return [p for _, p in sorted(found, key=lambda t: t[0])]

    async def derived(
        self, prepared: PreparedImage, name: str, build: Callable[[Path], Awaitable[None]]
    ) -> Path:
        """The artifact ``name`` derived from ``prepared`` (e.g. an image disk), built once by
        ``build(tmp_path)`` and published read-only (0444) inside the entry, so the size cap
        counts it and eviction removes it with the entry. The entry is marked most recently used
        and entries above ``max_bytes`` are evicted afterwards. Raises :class:`ImageError` when
        ``build`` fails, :class:`EvictedError` when the entry was evicted meanwhile."""
        lock = self._locks.setdefault(prepared.key, asyncio.Lock())
        async with lock:  # evict() skips an entry whose lock is held
            entry = self._images / prepared.key
            if not (entry / _INFO).exists():
                raise EvictedError(f"image {prepared.image_digest} was evicted from the cache")
            path = entry / _DERIVED / name
            if not path.is_file():
                path.parent.mkdir(mode=0o700, exist_ok=True)
                tmp = path.parent / f".{name}.{uuid.uuid4().hex}"
                try:
                    await build(tmp)
                    os.chmod(tmp, 0o444)
                    os.replace(tmp, path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        tmp.unlink()
            self._touch(prepared.key)
        await self.evict()
        return path

    async def evict(self) -> list[str]:
        """Evict least-recently-used, non-retained entries until the total is within
        ``max_bytes`` (the most recently used entry is always kept). Returns evicted keys."""
        async with self._evict_lock:
            entries = await asyncio.to_thread(self.entries)
            total = sum(e.size_bytes for e in entries)
            evicted: list[str] = []
            for e in entries[:-1]:
                if total <= self.max_bytes:
                    break
                if e.key in self._retained or self._locks.get(e.key, asyncio.Lock()).locked():
                    continue
                trash = self._tmp / f"evict-{e.key}-{uuid.uuid4().hex}"
                try:
                    os.rename(self._images / e.key, trash)
                except OSError:
                    continue
                await asyncio.to_thread(_remove_tree, trash)
                total -= e.size_bytes
                evicted.append(e.key)
            return evicted

    # ---------------------------------------------------------------- internals

    def _touch(self, key: str) -> None:
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(self._images / key, (now, now))

    def _load(self, key: str) -> PreparedImage:
        entry = self._images / key
        info = json.loads((entry / _INFO).read_text())
        derived = 0
        with contextlib.suppress(FileNotFoundError):
            derived = sum(p.lstat().st_blocks * 512 for p in (entry / _DERIVED).iterdir())
        return PreparedImage(
            rootfs=entry / "rootfs",
            key=key,
            image_digest=info["image_digest"],
            layer_digest=info["layer_digest"],
            size_bytes=int(info["size_bytes"]) + derived,
            verified_by=info.get("verified_by"),
        )
