"""The agent's image store (:mod:`impvm.agent.images`): one prepared image per (image, runner
layer) pair, built once - signatures checked, pulled, unpacked, made read-only - in a private
temp dir and published into the cache with an atomic ``rename``."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

from impvm.agent.images.cache import _INFO, ImageCache, PreparedImage, cache_key
from impvm.agent.images.pull import Skopeo
from impvm.agent.images.refs import ImageRef, _is_loopback, parse_reference
from impvm.agent.images.tree import _make_readonly, _remove_tree, _tree_size
from impvm.agent.images.unpack import unpack
from impvm.agent.layers import ImageTooLarge
from impvm.agent.runtime import ImageError
from impvm.agent.signing import TrustKey, Verifier


class ImageStore(ImageCache):
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
        super().__init__(cache_dir, max_bytes)
        self.insecure_registries = frozenset(insecure_registries)
        self.builds = 0
        self._skopeo = Skopeo(cache_dir, self.insecure_registries)
        self._verifier = Verifier(cache_dir / "trust", cosign)

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
        img_digest = await self._skopeo.resolve(image, allow_unpinned, auth_file, self.max_bytes)
        img_ref = parse_reference(image)
        layer_ref: ImageRef | None = None
        layer_digest: str | None = None
        if runner_layer:
            layer_digest = await self._skopeo.resolve(
                runner_layer, allow_unpinned, auth_file, self.max_bytes
            )
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
            await self._skopeo.copy(image, layout, "image", auth_file)
            if layer is not None:
                await self._skopeo.copy(layer, layout, "layer", auth_file)
                images.append(("layer", "runner layer", layer))
            bundle.mkdir(mode=0o700)
            await unpack(layout, images, bundle / "rootfs", self.max_bytes)
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
