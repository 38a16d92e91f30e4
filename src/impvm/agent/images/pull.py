"""Pulling with Debian's ``skopeo`` (:mod:`impvm.agent.images`): a reference's raw manifest
checked against its pinned digest (``skopeo inspect --raw``), the sizes it declares against the
cache's cap before a byte of a layer is fetched, and the copy by digest into a private OCI
layout."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

from impvm.agent.images.refs import ImageRef, parse_reference
from impvm.agent.layers import ImageTooLarge, declared_bytes, platform_manifest
from impvm.agent.runtime import ImageError
from impvm.agent.tools import run_tool

_POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'
#: OCI architecture names of the machines the agent runs on (``platform.machine()``)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


async def _run(what: str, *args: str) -> bytes:
    return await run_tool(what, *args, error=ImageError)


class Skopeo:
    """``skopeo`` as the image store runs it: with the policy file ``cache_dir/policy.json``
    (written when missing: skopeo's own signature policy accepts anything, the digests and
    cosign are the checks) and plain HTTP / no TLS verification for ``insecure_registries``."""

    def __init__(self, cache_dir: Path, insecure_registries: frozenset[str]) -> None:
        self.insecure_registries = insecure_registries
        self._policy = cache_dir / "policy.json"
        if not self._policy.exists():
            self._policy.write_text(_POLICY)

    def _tls_args(self, flag: str, ref: ImageRef) -> list[str]:
        return [f"--{flag}=false"] if ref.registry in self.insecure_registries else []

    async def inspect_raw(self, target: str, ref: ImageRef, auth_file: Path | None) -> bytes:
        """The raw manifest of ``target`` (``REPO@DIGEST`` or ``REPO:TAG``) as the registry
        serves it (``skopeo inspect --raw``)."""
        auth = ["--authfile", str(auth_file)] if auth_file else []
        return await _run(
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

    async def resolve(
        self, image: str, allow_unpinned: bool, auth_file: Path | None, max_bytes: int
    ) -> str:
        """Return the verified manifest digest of ``image``.

        Pinned: fetch the raw manifest by digest and check sha256(manifest) == digest. Unpinned:
        refuse unless ``allow_unpinned``; otherwise fetch by tag and return sha256(manifest).
        Then the sizes the manifest declares (of this host's platform, for a multi-platform
        image) must fit the cache's cap ``max_bytes``
        (:class:`~impvm.agent.layers.ImageTooLarge`).
        """
        ref = parse_reference(image)
        if ref.digest is None and not allow_unpinned:
            raise ImageError(
                f"image reference {image!r} is not pinned by digest; use "
                f"{ref.name}@sha256:<digest> (images are pulled by digest, never by tag)"
            )
        target = ref.pinned if ref.digest else f"{ref.name}:{ref.tag}"
        raw = await self.inspect_raw(target, ref, auth_file)
        actual = "sha256:" + hashlib.sha256(raw).hexdigest()
        if ref.digest and actual != ref.digest:
            raise ImageError(
                f"manifest digest mismatch for {image}: registry served {actual}, "
                f"pinned {ref.digest}"
            )
        await self._check_declared(raw, ref, image, auth_file, max_bytes)
        return actual

    async def _check_declared(
        self, raw: bytes, ref: ImageRef, image: str, auth_file: Path | None, max_bytes: int
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
                    json.loads(await self.inspect_raw(f"{ref.name}@{child}", ref, auth_file))
                )
        except (ValueError, TypeError, AttributeError):
            return  # not a manifest we read: skopeo's copy refuses it
        if declared is not None and declared > max_bytes:
            raise ImageTooLarge(
                f"{image} declares {declared} bytes of layers, more than the image cache's "
                f"size cap of {max_bytes} bytes; refused before it was pulled"
            )

    async def copy(self, pinned: str, layout: Path, tag: str, auth_file: Path | None) -> None:
        """``skopeo copy`` the pinned image into ``layout`` as ``tag``."""
        ref = parse_reference(pinned)
        auth = ["--src-authfile", str(auth_file)] if auth_file else []
        await _run(
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
