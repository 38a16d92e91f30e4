"""Same inputs, same digests: every image built again from scratch (``use_cache=False``, a fresh
OCI layout; the .deb files and wheels of the cache are the same inputs) has the digest of the
session's build.

The Debian roots take minutes each. A root whose rebuild already matched for the same input key
(lock entries, hook, mmdebstrap and umoci versions) on this machine is marked and taken from the
cache next time; everything else (the impvm and runner layers, every image's assembly) is rebuilt
on every run. ``IMPVM_IMAGES_FULL_REPRO=1`` rebuilds the roots too."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from impvm.agent.tools import run_tool
from impvm.images.build import build_images
from impvm.images.options import BuiltImage

from .conftest import build_options


@pytest.mark.timeout(2400)
async def test_a_rebuild_from_the_same_inputs_gives_the_same_digests(
    tmp_path: Path, built: dict[str, BuiltImage]
) -> None:
    main = built["impvm"].layout
    roots = sorted({t for b in built.values() for t in b.roots})
    assert len(roots) == 3
    marks = main.parent / f"{main.name}.reproduced"
    marks.mkdir(exist_ok=True)
    verified = os.environ.get("IMPVM_IMAGES_FULL_REPRO") != "1" and all(
        (marks / t).exists() for t in roots
    )
    layout = tmp_path / "oci"
    if verified:
        meta = tmp_path / "oci.meta"
        meta.mkdir()
        for tag in roots:
            await asyncio.to_thread(
                shutil.copy, main.parent / f"{main.name}.meta" / f"{tag}.json", meta
            )
            # the root as it is, same digest
            await run_tool(
                "skopeo copy",
                *("skopeo", "copy", "--quiet", "--preserve-digests"),
                *(f"oci:{main}:{tag}", f"oci:{layout}:{tag}"),
            )
    again = await build_images(
        build_options(use_cache=False, reuse_roots=verified, layout_dir=layout)
    )
    assert {i.name for i in again} == set(built)
    assert all(not i.cached for i in again)
    assert {i.name: i.digest for i in again} == {n: b.digest for n, b in built.items()}
    for tag in roots:
        (marks / tag).touch()
