"""Image preparation for the node agent: pull by digest, verify, unpack, add runner layer, cache.

Rules (the runner image contract: an immutable base image plus a runner layer, pulled by digest,
never by tag):

* A reference must be pinned (``REPO@sha256:<64 hex>``, a tag may precede the digest and is then
  ignored). A tag-only reference is refused with :class:`ImageError` unless ``allow_unpinned``;
  then the tag is resolved to a digest once and everything after uses the digest.
* Pulling uses Debian's ``skopeo`` (``docker://REPO@DIGEST`` into a private OCI layout). Before
  the copy the raw manifest is fetched (``skopeo inspect --raw``) and its sha256 must equal the
  pinned digest; skopeo's copy by digest verifies the same again, so a registry cannot swap content.
* Before the pull, the sizes the manifest declares (config and layers) must fit the cache's cap
  (``max_bytes``), so an image too big for the node is refused without a byte fetched.
* Assembly (:mod:`impvm.agent.layers`): the runner layer image's layers are stacked onto the base
  image's in one OCI image, every layer is read once as a stream and judged before anything is
  written (no entry, hard link or relative symlink leaving the root, no device node, the whole
  image within the cache's cap: a decompression bomb stops at the cap having written nothing),
  and ``umoci raw unpack`` (``--rootless`` when not root) writes the stacked image: umoci
  resolves every path inside the root (``securejoin``) and replaces a lower layer's symlink
  instead of writing through it, so no path of the image reaches the host. Whiteouts, ownership,
  modes and symlinks are umoci's; the runner layer may also delete files of the base image.
* Signatures (:mod:`impvm.agent.signing`): with ``public_key`` each pinned reference is checked
  by ``cosign verify`` right before skopeo copies that same digest, so an unsigned, wrongly
  signed or tampered image or runner layer is refused before a layer is fetched
  (:class:`~impvm.agent.signing.SignatureError` names it and says why).
* Prepared images are cached under ``cache_dir/images/<key>`` where ``key`` is derived from the
  pair (image manifest digest, runner-layer manifest digest) and, for a verified entry, from the
  key's fingerprint and both repositories: an entry verified against one key (or pulled without
  verification) is never handed to a request that requires another key; that request pulls and
  verifies again. A finished entry is made read-only
  (write bits removed recursively) and is never written by VMs (runtimes mount it read-only).
  A runtime may keep artifacts built from an entry (the ``qemu`` runtime's ext4 image disk) inside
  it (:meth:`ImageStore.derived`), so they count towards the cap and go with their entry.
  The total size is capped at ``max_bytes`` with least-recently-used eviction; entries retained by
  a running VM (:meth:`ImageStore.retain`) are never evicted by this process.
* Concurrent preparation of the same pair runs once per process (an asyncio lock per key) and is
  safe across processes: each build happens in a private temp dir and is published with an atomic
  ``rename``; a loser of the race discards its copy and uses the winner's.

All subprocesses run through :func:`asyncio.create_subprocess_exec`; blocking file-tree walks run
in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import platform
import re
import shutil
import stat
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from impvm.agent.layers import (
    ImageTooLarge,
    check_layers,
    declared_bytes,
    layer_blobs,
    platform_manifest,
    stack_images,
    tagged_manifest,
)
from impvm.agent.runtime import ImageError
from impvm.agent.signing import TrustKey, Verifier
from impvm.agent.tools import run_tool

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# the distribution project's reference grammar (reference/regexp.go)
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_HOST_COMPONENT}(?:\.{_HOST_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
_NAME_RE = re.compile(rf"^(?:{_HOST}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_TAG_RE = re.compile(r"^\w[\w.-]{0,127}$")
_POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'
_INFO = "impvm.json"
_DERIVED = "derived"
#: OCI architecture names of the machines the agent runs on (``platform.machine()``)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


class EvictedError(ImageError):
    """A cache entry was evicted while it was being used for more than one step: prepare it
    again."""


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: ``name`` (``registry/repo``, without tag or digest), ``tag`` and
    ``digest`` (``sha256:<hex>``), each optional but not both missing."""

    name: str
    tag: str | None
    digest: str | None

    @property
    def registry(self) -> str:
        """The registry host (``host[:port]``); ``docker.io`` when the name has no host part."""
        first, sep, _ = self.name.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            return first
        return "docker.io"

    @property
    def pinned(self) -> str:
        """``name@digest``; raises :class:`ImageError` when there is no digest."""
        if self.digest is None:
            raise ImageError(f"image reference {self.name!r} is not pinned by digest")
        return f"{self.name}@{self.digest}"


def parse_reference(ref: str) -> ImageRef:
    """Parse ``[registry/]repo[:tag][@sha256:<64 hex>]``.

    The name and tag must follow the grammar of the distribution project's image references
    (``reference/reference.go``: lower-case path components, a host with an optional port, a
    tag of word characters, dots and dashes): so a reference can never look like an option
    (``-v``, ``--key=...``) to a tool it is handed to. A reference with neither tag nor digest
    means tag ``latest`` (and is therefore unpinned). Raises :class:`ImageError` for an empty or
    malformed reference or a malformed digest (only ``sha256`` digests are accepted).
    """
    ref = ref.strip()
    if not ref or any(c.isspace() for c in ref):
        raise ImageError(f"invalid image reference {ref!r}")
    name, at, digest = ref.partition("@")
    if at and not _DIGEST_RE.match(digest):
        raise ImageError(f"invalid digest in image reference {ref!r} (want sha256:<64 hex>)")
    tag: str | None = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
    if not _NAME_RE.match(name) or (tag is not None and not _TAG_RE.match(tag)):
        raise ImageError(
            f"invalid image reference {ref!r} (want [host[:port]/]path[:tag][@sha256:<hex>], "
            "path in lower case)"
        )
    if not at and tag is None:
        tag = "latest"
    return ImageRef(name=name, tag=tag, digest=digest if at else None)


def _is_loopback(registry: str) -> bool:
    host = registry
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


class ImageStore:
    """A node-local cache of prepared images.

    ``cache_dir``: owned by the agent (created 0700); ``max_bytes``: size cap in bytes of all
    prepared entries; an image that alone unpacks to more is refused while it is read (an
    artifact derived from an entry may still take it over the cap while it is the newest);
    ``insecure_registries``: ``host:port`` of registries reached over plain HTTP / without TLS
    verification; only loopback registries are accepted (``ValueError`` otherwise).
    ``cosign``: the cosign binary that verifies signatures (run only for a ``public_key``).

    ``builds`` counts the entries this instance actually built (cache misses), for tests.
    """

    def __init__(
        self,
        cache_dir: Path,
        max_bytes: int,
        insecure_registries: set[str] | frozenset[str] = frozenset(),
        cosign: str = "cosign",
    ) -> None:
        for reg in insecure_registries:
            if not _is_loopback(reg):
                raise ValueError(f"insecure registry {reg!r} is not a loopback address")
        self.cache_dir = cache_dir
        self.max_bytes = max_bytes
        self.insecure_registries = frozenset(insecure_registries)
        self.builds = 0
        self._images = cache_dir / "images"
        self._tmp = cache_dir / "tmp"
        self._locks: dict[str, asyncio.Lock] = {}
        self._evict_lock = asyncio.Lock()
        self._retained: dict[str, int] = {}
        for d in (cache_dir, self._images, self._tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(cache_dir, 0o700)
        self._policy = cache_dir / "policy.json"
        if not self._policy.exists():
            self._policy.write_text(_POLICY)
        self._verifier = Verifier(cache_dir / "trust", cosign)

    # ---------------------------------------------------------------- public

    async def prepare(
        self,
        image: str,
        runner_layer: str | None = None,
        allow_unpinned: bool = False,
        auth_file: Path | None = None,
        public_key: str | None = None,
    ) -> PreparedImage:
        """Pull, verify, unpack and layer ``image`` + ``runner_layer`` (or return the cached entry).

        ``auth_file``: a docker-config-style auth file (``{"auths": {...}}``) for both registries.
        ``public_key``: a PEM public key; when given, both must carry a sigstore signature by it
        (checked by cosign right before each pull; a cached entry counts only if it was verified
        against the same key and repositories). Raises :class:`ImageError` for a tag-only reference
        without ``allow_unpinned`` (naming the reference), an unknown manifest, a digest
        mismatch, a registry/auth failure or an unpack failure, and its subclasses
        :class:`~impvm.agent.signing.SignatureError` for a missing, foreign or tampered
        signature, :class:`~impvm.agent.layers.ImageRefused` for a layer entry that would
        leave the root or is a device node, :class:`~impvm.agent.layers.ImageTooLarge` for an
        image bigger than ``max_bytes``. Marks the entry as most recently used and then evicts
        least-recently-used entries above ``max_bytes``.
        """
        trust = self._verifier.key_for(public_key, "image", image) if public_key else None
        img_digest = await self._resolve(image, allow_unpinned, auth_file)
        img_ref = parse_reference(image)
        layer_ref: ImageRef | None = None
        layer_digest: str | None = None
        if runner_layer:
            layer_digest = await self._resolve(runner_layer, allow_unpinned, auth_file)
            layer_ref = parse_reference(runner_layer)
        scope = None
        if trust is not None:
            # signatures live in the image's repository: the same digest elsewhere is verified
            # there, separately
            scope = f"{trust.fingerprint}\n{img_ref.name}\n{layer_ref.name if layer_ref else '-'}"
        key = cache_key(img_digest, layer_digest, scope)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            entry = self._images / key
            if not (entry / _INFO).exists():
                pinned_layer = (
                    f"{layer_ref.name}@{layer_digest}" if layer_ref and layer_digest else None
                )
                await self._build(
                    key, f"{img_ref.name}@{img_digest}", pinned_layer, auth_file, trust
                )
            prepared = await asyncio.to_thread(self._load, key)
            self._touch(key)
        await self.evict()
        return prepared

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

    def _tls_args(self, flag: str, ref: ImageRef) -> list[str]:
        return [f"--{flag}=false"] if ref.registry in self.insecure_registries else []

    async def _run(self, what: str, *args: str) -> bytes:
        return await run_tool(what, *args, error=ImageError)

    async def _inspect_raw(self, target: str, ref: ImageRef, auth_file: Path | None) -> bytes:
        """The raw manifest of ``target`` (``REPO@DIGEST`` or ``REPO:TAG``) as the registry
        serves it (``skopeo inspect --raw``)."""
        auth = ["--authfile", str(auth_file)] if auth_file else []
        return await self._run(
            f"fetching the manifest of {target}",
            "skopeo",
            "--policy",
            str(self._policy),
            "inspect",
            "--raw",
            "--retry-times",
            "2",
            *self._tls_args("tls-verify", ref),
            *auth,
            "--",
            f"docker://{target}",
        )

    async def _resolve(self, image: str, allow_unpinned: bool, auth_file: Path | None) -> str:
        """Return the verified manifest digest of ``image``.

        Pinned: fetch the raw manifest by digest and check sha256(manifest) == digest. Unpinned:
        refuse unless ``allow_unpinned``; otherwise fetch by tag and return sha256(manifest).
        Then the sizes the manifest declares (of this host's platform, for a multi-platform
        image) must fit the cache's cap (:class:`~impvm.agent.layers.ImageTooLarge`).
        """
        ref = parse_reference(image)
        if ref.digest is None and not allow_unpinned:
            raise ImageError(
                f"image reference {image!r} is not pinned by digest; use "
                f"{ref.name}@sha256:<digest> (images are pulled by digest, never by tag)"
            )
        target = ref.pinned if ref.digest else f"{ref.name}:{ref.tag}"
        raw = await self._inspect_raw(target, ref, auth_file)
        actual = "sha256:" + hashlib.sha256(raw).hexdigest()
        if ref.digest and actual != ref.digest:
            raise ImageError(
                f"manifest digest mismatch for {image}: registry served {actual}, "
                f"pinned {ref.digest}"
            )
        await self._check_declared(raw, ref, image, auth_file)
        return actual

    async def _check_declared(
        self, raw: bytes, ref: ImageRef, image: str, auth_file: Path | None
    ) -> None:
        """Refuse ``image`` before its pull when its manifest (or, for a multi-platform image,
        this platform's) declares more bytes than the cache may hold; skopeo then checks every
        blob it copies against its declared size and digest."""
        try:
            manifest = json.loads(raw)
            declared = declared_bytes(manifest)
            if declared is None:
                child = platform_manifest(manifest, arch=_ARCH.get(platform.machine(), ""))
                if child is None:
                    return  # skopeo's copy names the missing platform
                declared = declared_bytes(
                    json.loads(await self._inspect_raw(f"{ref.name}@{child}", ref, auth_file))
                )
        except (ValueError, TypeError, AttributeError):
            return  # not a manifest we read: skopeo's copy refuses it
        if declared is not None and declared > self.max_bytes:
            raise ImageTooLarge(
                f"{image} declares {declared} bytes of layers, more than the image cache's "
                f"size cap of {self.max_bytes} bytes; refused before it was pulled"
            )

    async def _copy(self, pinned: str, layout: Path, tag: str, auth_file: Path | None) -> None:
        """``skopeo copy`` the pinned image into ``layout`` as ``tag``."""
        ref = parse_reference(pinned)
        auth = ["--src-authfile", str(auth_file)] if auth_file else []
        await self._run(
            f"pulling {pinned}",
            "skopeo",
            "--policy",
            str(self._policy),
            "copy",
            "--quiet",
            "--retry-times",
            "2",
            *self._tls_args("src-tls-verify", ref),
            *auth,
            "--",
            f"docker://{pinned}",
            f"oci:{layout}:{tag}",
        )

    async def _unpack(self, layout: Path, images: list[tuple[str, str, str]], rootfs: Path) -> None:
        """Stack the ``(tag, role, pinned)`` images of ``layout`` (base first) into one image,
        check every layer of it (:func:`impvm.agent.layers.check_layers`, against the cache's
        cap) and let ``umoci raw unpack`` write it to ``rootfs``. Raises
        :class:`~impvm.agent.layers.ImageRefused` or :class:`~impvm.agent.layers.ImageTooLarge`
        before anything is written, :class:`ImageError` when umoci fails."""
        tag = images[0][0]
        if len(images) > 1:
            tag = "stacked"
            await asyncio.to_thread(stack_images, layout, images[0][0], images[1][0], tag)
        owners = []
        for t, role, pinned in images:
            count = len((await asyncio.to_thread(tagged_manifest, layout, t)).get("layers") or [])
            owners.append((count, f"{role} {pinned}"))
        blobs = await asyncio.to_thread(layer_blobs, layout, tag, owners)
        await asyncio.to_thread(check_layers, blobs, self.max_bytes)
        rootless = ["--rootless"] if os.geteuid() != 0 else []
        await self._run(
            f"unpacking {' + '.join(p for _, _, p in images)}",
            "umoci",
            "raw",
            "unpack",
            *rootless,
            "--image",
            f"{layout}:{tag}",
            str(rootfs),
        )

    async def _build(
        self,
        key: str,
        image: str,
        layer: str | None,
        auth_file: Path | None,
        trust: TrustKey | None,
    ) -> None:
        work = self._tmp / f"build-{key}-{uuid.uuid4().hex}"
        work.mkdir(mode=0o700)
        try:
            layout = work / "oci"
            bundle = work / "entry"
            if trust is not None:
                # both before either is pulled; the pulls below name the same pinned digests
                for role, pinned in (("image", image), ("runner layer", layer)):
                    if pinned is not None:
                        insecure = parse_reference(pinned).registry in self.insecure_registries
                        await self._verifier.verify(
                            trust, role, pinned, insecure=insecure, auth_file=auth_file
                        )
            images = [("image", "image", image)]
            await self._copy(image, layout, "image", auth_file)
            if layer is not None:
                await self._copy(layer, layout, "layer", auth_file)
                images.append(("layer", "runner layer", layer))
            bundle.mkdir(mode=0o700)
            await self._unpack(layout, images, bundle / "rootfs")
            size = await asyncio.to_thread(_tree_size, bundle / "rootfs")
            if size > self.max_bytes:  # the check above counts conservatively; never reached
                raise ImageTooLarge(
                    f"{image} unpacked to {size} bytes, over the image cache's size cap"
                )
            info = {
                "image": image,
                "image_digest": parse_reference(image).digest,
                "runner_layer": layer,
                "layer_digest": parse_reference(layer).digest if layer else None,
                "size_bytes": size,
                "verified_by": trust.fingerprint if trust else None,
                "created": time.time(),
            }
            (bundle / _INFO).write_text(json.dumps(info, indent=1) + "\n")
            # The rootfs loses every write bit; the entry dir itself stays owner-writable so that
            # it can be renamed (publish/evict) without root.
            await asyncio.to_thread(_make_readonly, bundle / "rootfs")
            os.chmod(bundle / _INFO, 0o444)
            try:
                os.rename(bundle, self._images / key)  # atomic publish
            except OSError:
                # Another process published the same key first: use theirs.
                if not (self._images / key / _INFO).exists():
                    raise
            else:
                self.builds += 1
        except ImageError:
            raise
        except OSError as exc:
            raise ImageError(f"preparing {image} failed: {exc}") from exc
        finally:
            await asyncio.to_thread(_remove_tree, work)
