"""OCI image layouts as the agent's image store keeps them: the manifest of a tag, a runner layer
image stacked onto its base image under a new tag (:func:`stack_images`, so that ``umoci``
unpacks both into one root), an image's layers in order with whose they are
(:func:`layer_blobs`), and what a manifest or an index declares."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from impvm.agent.layers.rules import ImageRefused
from impvm.agent.layers.scan import LayerBlob

_REF_NAME = "org.opencontainers.image.ref.name"
_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


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
