"""A runner tarball is read whole before any of it is written (``impvm images build
runner-layer``): one that inflates beyond the build's cap, or writes below a symlink it made, is
refused naming the entry, and nothing of it is left in the cache."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from impvm.images.build import build_images
from impvm.images.options import BuildOptions, ImageBuildError, RunnerSource
from tests.agent.hostile import Zeros

from .conftest import lock_copy

VERSION = "2.999.1"


def _release(path: Path, extra: list[tuple[tarfile.TarInfo, io.RawIOBase | None]]) -> str:
    """A tarball with ``run.sh`` and ``extra``; returns its sha256."""
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        run = b"#!/bin/bash\necho runner\n"
        info = tarfile.TarInfo("./run.sh")
        info.size, info.mode = len(run), 0o755
        tar.addfile(info, io.BytesIO(run))
        for member, data in extra:
            tar.addfile(member, io.BufferedReader(data) if data is not None else None)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _options(tmp_path: Path, tarball: Path, sha: str) -> BuildOptions:
    return BuildOptions(
        lock_path=lock_copy(),
        cache_dir=tmp_path / "cache",
        images=("runner-layer",),
        runner=RunnerSource(version=VERSION, sha256=sha, tarball=tarball),
        runner_max_bytes=64 << 20,
        log=lambda _line: None,
    )


def _nothing_left(tmp_path: Path) -> None:
    tmp = tmp_path / "cache" / "tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == []


async def test_a_runner_tarball_bomb_is_refused_before_it_is_written(tmp_path: Path) -> None:
    """300 MiB of zeros (about 300 KB compressed) against a cap of 64 MiB."""
    bomb = tarfile.TarInfo("./bin/Runner.Listener")
    bomb.size, bomb.mode = 300 << 20, 0o755
    tarball = tmp_path / "bomb.tar.gz"
    sha = _release(tarball, [(bomb, Zeros(bomb.size))])
    with pytest.raises(ImageBuildError, match="more than the image cache's size cap of 64 MiB"):
        await build_images(_options(tmp_path, tarball, sha))
    _nothing_left(tmp_path)


async def test_a_runner_tarball_writing_through_its_own_symlink_is_refused(
    tmp_path: Path,
) -> None:
    """``bin -> <host dir>`` then ``bin/planted``: refused by name, the host dir stays empty."""
    outside = tmp_path / "outside"
    outside.mkdir()
    link = tarfile.TarInfo("./bin")
    link.type, link.linkname = tarfile.SYMTYPE, str(outside)
    planted = tarfile.TarInfo("./bin/planted")
    planted.size = 4
    tarball = tmp_path / "through.tar.gz"
    sha = _release(tarball, [(link, None), (planted, io.BytesIO(b"evil"))])
    with pytest.raises(
        ImageBuildError, match=r"'\./bin/planted' is refused: it lies below a symlink"
    ):
        await build_images(_options(tmp_path, tarball, sha))
    assert list(outside.iterdir()) == []
    _nothing_left(tmp_path)
