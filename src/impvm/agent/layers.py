"""Image layers judged before any of their bytes reach the disk, and a runner layer stacked onto
its base image as one OCI image, so that ``umoci`` writes every path of both inside one root.

Why: an image is input from outside (its publisher is not trusted), and the agent unpacks it as
root. Every path a layer writes must resolve inside the image's root, and the image may not be
bigger than the node's image cache.

* **Stacking** (:func:`stack_images`): the runner layer image's layers are appended to the base
  image's (manifest ``layers`` and config ``rootfs.diff_ids``, OCI image spec "Image Manifest"
  and "Image Configuration") under a new tag in the same OCI layout, and ``umoci raw unpack``
  applies them in order. umoci resolves the directory of every entry inside the root
  (``securejoin``, the scoped path resolution runc and containerd use), replaces whatever the
  lower layers left at an entry's own path instead of following it, scopes hard-link targets to
  the root and applies whiteouts: a base image's symlink at ``usr/local/bin/runner`` pointing to
  a host file is replaced by the runner layer's file, never written through.
* **Rules checked first** (:func:`entry_problem`, pure), the breakout rules of Docker's layer
  extraction (moby ``pkg/archive``: "invalid hardlink", "invalid symlink", breakout errors): an
  entry's name may not leave the root through ``..``; a hard link's target, taken from the
  root, may not leave it; a relative symlink's target, taken from the link's directory, may not
  leave it (an absolute target is resolved inside the root, by umoci here and by the guest at run
  time); and, beyond Docker, no character or block device node (an OCI layer carries none: the
  runtime provides ``/dev``; a device node in the cache would give whoever opens it a host
  device). A layer breaking one is refused whole (:class:`ImageRefused`), naming the layer, the
  entry and the rule.
* **Size while reading** (:func:`check_layers`): each layer is decompressed as a stream and its
  tar headers are read with ``tarfile`` without extracting anything; every entry is charged
  :data:`ENTRY_BYTES` plus its data rounded up to 4 KiB blocks (a directory one block) against
  one budget for the whole image, the image cache's size cap. The first entry that passes the
  budget stops the read (:class:`ImageTooLarge`): a small compressed layer that expands beyond
  the cap (a decompression bomb) costs the time to inflate up to the cap and no disk at all. No
  single read is larger than :data:`MAX_HEADER_BYTES` (``tarfile`` reads a PAX or GNU long-name
  header whole), so memory stays bounded too.

The layout and its blobs are private to the agent (the image store's temp dir, 0700) and umoci
verifies every blob against its digest as it reads, so what umoci unpacks is what was checked.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

from impvm.agent.runtime import ImageError

#: What every entry costs the budget beyond its data (an inode and a directory entry), bytes.
ENTRY_BYTES = 512
#: Data is charged in whole blocks of this many bytes (a directory one block).
BLOCK_BYTES = 4096
#: The largest single read of a layer's tar stream (a PAX or GNU long-name header), bytes.
MAX_HEADER_BYTES = 1 << 20
_REF_NAME = "org.opencontainers.image.ref.name"
_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


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


# ---------------------------------------------------------------------------- OCI layouts


def _blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise ImageRefused(f"unsupported blob digest {digest!r}")
    return layout / "blobs" / algo / hexd


def _read_json(layout: Path, digest: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_blob_path(layout, digest).read_bytes())
    return data


def _write_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = _blob_path(layout, digest)
    if not path.exists():
        path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _index(layout: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((layout / "index.json").read_text())
    return data


def tagged_manifest(layout: Path, tag: str) -> dict[str, Any]:
    """The image manifest tagged ``tag`` in the OCI layout ``layout`` (blocking). Raises
    :class:`ImageRefused` when there is none."""
    for desc in _index(layout).get("manifests") or []:
        if (desc.get("annotations") or {}).get(_REF_NAME) == tag:
            return _read_json(layout, str(desc["digest"]))
    raise ImageRefused(f"no image tagged {tag!r} in {layout}")


def stacked(
    base: dict[str, Any],
    base_config: dict[str, Any],
    top: dict[str, Any],
    top_config: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The image manifest and config of ``top``'s layers applied over ``base``'s (pure): the
    base's config with both images' ``rootfs.diff_ids`` and ``history`` in order, and a
    manifest whose ``layers`` are both lists in order. The manifest's ``config`` descriptor is
    left for the caller (it names the config's digest)."""
    config = json.loads(json.dumps(base_config))
    rootfs = config.setdefault("rootfs", {"type": "layers"})
    rootfs["diff_ids"] = [
        *(base_config.get("rootfs") or {}).get("diff_ids", []),
        *(top_config.get("rootfs") or {}).get("diff_ids", []),
    ]
    history = [*(base_config.get("history") or []), *(top_config.get("history") or [])]
    if history:
        config["history"] = history
    manifest = {
        "schemaVersion": 2,
        "mediaType": _MANIFEST_TYPE,
        "config": dict(base["config"]),
        "layers": [*base.get("layers", []), *top.get("layers", [])],
    }
    return manifest, config


def stack_images(layout: Path, base_tag: str, top_tag: str, tag: str) -> None:
    """Tag ``tag`` in ``layout``: the image ``top_tag``'s layers over ``base_tag``'s
    (:func:`stacked`; blocking). The layout is private to the caller (no lock)."""
    base = tagged_manifest(layout, base_tag)
    top = tagged_manifest(layout, top_tag)
    manifest, config = stacked(
        base,
        _read_json(layout, base["config"]["digest"]),
        top,
        _read_json(layout, top["config"]["digest"]),
    )
    manifest["config"].update(_write_blob(layout, json.dumps(config).encode()))
    desc = _write_blob(layout, json.dumps(manifest).encode())
    index = _index(layout)
    index.setdefault("manifests", []).append(
        {"mediaType": _MANIFEST_TYPE, **desc, "annotations": {_REF_NAME: tag}}
    )
    tmp = layout / "index.json.tmp"
    tmp.write_text(json.dumps(index))
    tmp.replace(layout / "index.json")


def layer_blobs(layout: Path, tag: str, owners: Sequence[tuple[int, str]]) -> list[LayerBlob]:
    """The layers of image ``tag`` in order; ``owners``: ``(how many layers, what)`` per image
    stacked into it, bottom first (the rest are named by the last)."""
    layers = tagged_manifest(layout, tag).get("layers") or []
    out: list[LayerBlob] = []
    for i, desc in enumerate(layers):
        seen = 0
        what = owners[-1][1] if owners else "image"
        for count, name in owners:
            if i < seen + count:
                what = name
                break
            seen += count
        digest = str(desc["digest"])
        out.append(LayerBlob(_blob_path(layout, digest), digest, what))
    return out


def declared_bytes(manifest: dict[str, Any]) -> int | None:
    """The bytes an image manifest says its config and layers take (compressed), None for an
    index (a multi-platform image: its platform's manifest says)."""
    if manifest.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
        return None
    sizes = [manifest.get("config") or {}, *(manifest.get("layers") or [])]
    return sum(max(0, int(d.get("size") or 0)) for d in sizes)


def platform_manifest(index: dict[str, Any], os: str = "linux", arch: str = "amd64") -> str | None:
    """The digest of ``index``'s manifest for ``os``/``arch`` (what skopeo copies from a
    multi-platform image on this host), None when it has none."""
    for desc in index.get("manifests") or []:
        platform = desc.get("platform") or {}
        if platform.get("os") == os and platform.get("architecture") == arch:
            return str(desc["digest"])
    return None
