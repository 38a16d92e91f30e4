"""Unpacking with ``umoci`` (:mod:`impvm.agent.images`): the runner layer's image stacked onto
the base image's, every layer judged before anything is written
(:func:`impvm.agent.layers.check_layers`), then ``umoci raw unpack`` into the entry's root."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from impvm.agent.layers import check_layers, layer_blobs, stack_images, tagged_manifest
from impvm.agent.runtime import ImageError
from impvm.agent.tools import run_tool


async def unpack(
    layout: Path, images: list[tuple[str, str, str]], rootfs: Path, max_bytes: int
) -> None:
    """Stack the ``(tag, role, pinned)`` images of ``layout`` (base first) into one image,
    check every layer of it (:func:`impvm.agent.layers.check_layers`, against the cache's
    cap ``max_bytes``) and let ``umoci raw unpack`` write it to ``rootfs``. Raises
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
    await asyncio.to_thread(check_layers, blobs, max_bytes)
    rootless = ["--rootless"] if os.geteuid() != 0 else []
    await run_tool(
        f"unpacking {' + '.join(p for _, _, p in images)}",
        "umoci",
        "raw",
        "unpack",
        *rootless,
        "--image",
        f"{layout}:{tag}",
        str(rootfs),
        error=ImageError,
    )
