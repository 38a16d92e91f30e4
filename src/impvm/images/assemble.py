"""An image assembled in the OCI layout from its layers (a Debian root's image tagged anew, then
the other layers added verbatim with ``umoci raw add-layer``) and configured (``umoci config``),
tagged ``<image>-<key>`` over everything that goes into it; a tag already built is reused.
Raises :class:`ImageBuildError`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from impvm.images.context import BuildContext, created_time
from impvm.images.keys import input_key
from impvm.images.layers import app_layer, cosign_layer, runner_layer
from impvm.images.options import BuiltImage, ImageBuildError
from impvm.images.roots import build_root
from impvm.images.spec import ImageSpec, image_config_args
from impvm.images.tarballs import sha256_file


async def assemble_image(ctx: BuildContext, spec: ImageSpec, work: Path) -> BuiltImage:
    """The image ``spec``, assembled in the layout (or taken from the cache)."""
    assert ctx.lock is not None
    layers: list[tuple[str, str, Path | None, int]] = []  # (kind, key, tar, unpacked)
    for layer in spec.layers:
        layers.append(await _layer(ctx, layer, work))
    key = input_key(
        repr(spec),
        ctx.tools,
        str(ctx.lock.debian.source_date_epoch),
        *(k for _, k, _, _ in layers),
    )
    tag = f"{spec.name}-{key[:16]}"
    roots = tuple(k for kind, k, _, _ in layers if kind.startswith("root:"))
    if ctx.cached(tag):
        ctx.log(f"{spec.name}: cached ({tag})")
        return ctx.built(spec.name, tag, cached=True, roots=roots)
    ctx.log(f"{spec.name}: assembling {tag}")
    created = created_time(ctx.lock.debian.source_date_epoch)
    ref = f"{ctx.layout}:{tag}"
    first_kind, first_key, _, _ = layers[0]
    with contextlib.suppress(ImageBuildError):
        await ctx.tool("umoci rm", "umoci", "rm", "--image", ref)
    if first_kind.startswith("root:"):
        await ctx.tool("umoci tag", "umoci", "tag", "--image", f"{ctx.layout}:{first_key}", tag)
        rest = layers[1:]
    else:
        await ctx.tool("umoci new", "umoci", "new", "--image", ref)
        rest = layers
    for kind, _, tar, _ in rest:
        assert tar is not None
        await ctx.tool(
            f"adding the {kind} layer to {spec.name}",
            "umoci",
            "raw",
            "add-layer",
            "--image",
            ref,
            "--history.created",
            created,
            "--history.created_by",
            f"impvm images build ({kind})",
            str(tar),
        )
    await ctx.tool(
        f"configuring {spec.name}",
        "umoci",
        "config",
        "--image",
        ref,
        *image_config_args(spec, created),
    )
    unpacked = sum(u for _, _, _, u in layers)
    ctx.meta_path(tag).write_text(json.dumps({"unpacked_bytes": unpacked}) + "\n")
    return ctx.built(spec.name, tag, cached=False, roots=roots)


async def _layer(ctx: BuildContext, layer: str, work: Path) -> tuple[str, str, Path | None, int]:
    """Returns (kind, key, tar path or None for a root, unpacked bytes). For a root the key
    is its tag in the layout."""
    if layer.startswith("root:"):
        tag = await build_root(ctx, layer.removeprefix("root:"), work)
        ctx.layer_keys[layer] = tag
        return layer, tag, None, int(str(ctx.meta(tag).get("unpacked_bytes", 0)))
    make = {"app": app_layer, "cosign": cosign_layer, "runner": runner_layer}
    if layer in make:
        tar, size_file = work / f"{layer}.tar", work / f"{layer}.size"
        if not tar.exists():  # each layer once per build, however many images share it
            size_file.write_text(str(await make[layer](ctx, work, tar)))
        key = await asyncio.to_thread(sha256_file, tar)
        return layer, key, tar, int(size_file.read_text())
    raise ImageBuildError(f"unknown layer {layer!r}")
