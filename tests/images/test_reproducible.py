"""Same inputs, same digests: every image built again from scratch (``use_cache=False``, a fresh
OCI layout; the .deb files and wheels of the cache are the same inputs) has the digest of the
session's build."""

from __future__ import annotations

from pathlib import Path

import pytest

from impvm.images.build import BuiltImage, build_images

from .conftest import build_options


@pytest.mark.timeout(2400)
async def test_a_rebuild_from_the_same_inputs_gives_the_same_digests(
    tmp_path: Path, built: dict[str, BuiltImage]
) -> None:
    again = await build_images(build_options(use_cache=False, layout_dir=tmp_path / "oci"))
    assert {i.name for i in again} == set(built)
    assert all(not i.cached for i in again)
    assert {i.name: i.digest for i in again} == {n: b.digest for n, b in built.items()}
