"""One build run's shared state (:class:`BuildContext`): the options, the cache and its OCI layout
(tags, blobs, the size metadata kept beside it), the lock as read (written back at once when a
build updates it), the tool versions; running a tool. Raises :class:`ImageBuildError`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime
from pathlib import Path

from impvm.agent.tools import run_tool
from impvm.images.lock import Lock, dump_lock
from impvm.images.options import BuildOptions, BuiltImage, ImageBuildError


class BuildContext:
    """What every phase of one build run shares (see :class:`impvm.images.build.Builder`)."""

    def __init__(self, opts: BuildOptions) -> None:
        self.opts = opts
        self.cache = opts.cache_dir
        self.layout = opts.layout_dir or self.cache / "oci"
        self.lock: Lock | None = None
        self.lock_changed = False
        #: layer name ("root:<name>", "app", "runner") -> (key, tag or tar path, unpacked size)
        self.layer_keys: dict[str, str] = {}
        self.wheels_checked = False
        #: versions of the tools whose output the digests depend on (part of every key)
        self.tools = ""

    def log(self, line: str) -> None:
        self.opts.log(line)

    async def tool(self, what: str, *args: str, env: dict[str, str] | None = None) -> bytes:
        if env is None:
            return await run_tool(what, *args, error=ImageBuildError)
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            detail = (err or out).decode(errors="replace").strip()[-2000:]
            raise ImageBuildError(f"{what} failed (exit {proc.returncode}): {detail}")
        return out

    def record_lock(self) -> None:
        """Write the updated lock at once, so a later failure keeps what was learnt."""
        self.lock_changed = True
        self.opts.lock_path.write_text(dump_lock(self.locked()))
        self.log(f"lock updated: {self.opts.lock_path}")

    @staticmethod
    def mkdir(p: Path) -> Path:
        p.mkdir(parents=True, exist_ok=True)
        return p

    def locked(self) -> Lock:
        assert self.lock is not None
        return self.lock

    def index(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads((self.layout / "index.json").read_text())
        except (OSError, ValueError):
            return {}
        out = {}
        for m in data.get("manifests") or []:
            tag = (m.get("annotations") or {}).get("org.opencontainers.image.ref.name")
            if tag:
                out[tag] = m
        return out

    def blob(self, digest: str) -> bytes:
        algo, _, hexd = digest.partition(":")
        return (self.layout / "blobs" / algo / hexd).read_bytes()

    def built(self, name: str, tag: str, cached: bool, roots: tuple[str, ...] = ()) -> BuiltImage:
        desc = self.index()[tag]
        digest = str(desc["digest"])
        manifest = json.loads(self.blob(digest))
        size = int(str(desc["size"])) + int(manifest["config"]["size"])
        size += sum(int(layer["size"]) for layer in manifest["layers"])
        meta = self.meta(tag)
        return BuiltImage(
            name=name,
            layout=self.layout,
            tag=tag,
            digest=digest,
            size_bytes=size,
            unpacked_bytes=int(str(meta.get("unpacked_bytes", 0))),
            cached=cached,
            roots=roots,
        )

    def meta_path(self, tag: str) -> Path:
        return self.mkdir(self.layout.parent / f"{self.layout.name}.meta") / f"{tag}.json"

    def meta(self, tag: str) -> dict[str, object]:
        try:
            data: dict[str, object] = json.loads(self.meta_path(tag).read_text())
            return data
        except (OSError, ValueError):
            return {}

    def cached(self, tag: str, root: bool = False) -> bool:
        use = self.opts.use_cache or (root and self.opts.reuse_roots)
        return use and tag in self.index() and bool(self.meta(tag))

    async def prune(self, keep: list[str]) -> None:
        """Remove tags of the built images' names (and roots) other than the current ones, then
        garbage-collect unreferenced blobs."""
        keep_set = set(keep) | set(self.layer_keys.values())
        names = {t.rsplit("-", 1)[0] for t in keep_set}
        removed = False
        for tag in self.index():
            if tag not in keep_set and tag.rsplit("-", 1)[0] in names:
                await self.tool("umoci rm", "umoci", "rm", "--image", f"{self.layout}:{tag}")
                with contextlib.suppress(OSError):
                    self.meta_path(tag).unlink()
                removed = True
        if removed:
            await self.tool("umoci gc", "umoci", "gc", "--layout", str(self.layout))


def created_time(epoch: int) -> str:
    """``epoch`` as the RFC 3339 time umoci records (``created``, the history's times)."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
