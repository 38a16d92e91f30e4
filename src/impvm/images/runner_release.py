"""The GitHub Actions runner release of the runner layer: its tarball (given, kept in
``cache/downloads`` or downloaded), refused unless its sha256 is the published one
(:class:`RunnerChecksumError`), read whole before it is unpacked. Raises
:class:`ImageBuildError`."""

from __future__ import annotations

import asyncio
import os
import tarfile
from pathlib import Path

from impvm.agent.layers import Budget, scan_layer
from impvm.agent.runtime import ImageError
from impvm.images.context import BuildContext
from impvm.images.lock import Lock, RunnerRelease
from impvm.images.options import RUNNER_MAX_BYTES, ImageBuildError
from impvm.images.tarballs import CHUNK, sha256_file


class RunnerChecksumError(ImageBuildError):
    """The runner tarball's sha256 is not the one published for the release: refused."""


def verify_runner_tarball(path: Path, expected: str, version: str) -> None:
    """Raise :class:`RunnerChecksumError` unless ``sha256(path) == expected``."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise RunnerChecksumError(
            f"{path.name}: sha256 is {actual}, but the checksum published for runner "
            f"{version} is {expected}; refusing to build the runner layer from it"
        )


async def unpack_runner_release(ctx: BuildContext, home: Path) -> None:
    """The runner release ``ctx.opts.runner`` names (default: the lock's), checked and unpacked
    into ``home`` (:func:`_extract_runner`)."""
    release, tarball = await _runner_tarball(ctx, ctx.locked())
    ctx.log(f"runner-layer: GitHub Actions runner {release.version}")
    await asyncio.to_thread(_extract_runner, tarball, home, ctx.opts.runner_max_bytes)


async def _runner_tarball(ctx: BuildContext, lock: Lock) -> tuple[RunnerRelease, Path]:
    src = ctx.opts.runner
    version = src.version or lock.runner.version
    sha = src.sha256
    if sha is None and version == lock.runner.version:
        sha = lock.runner.sha256
    if sha is None:
        raise ImageBuildError(
            f"runner {version}: give its published sha256 (--runner-sha256); the lock "
            f"only knows {lock.runner.version}"
        )
    release = RunnerRelease(version=version, sha256=sha, url=src.url or lock.runner.url)
    if src.tarball is not None:
        await asyncio.to_thread(verify_runner_tarball, src.tarball, release.sha256, version)
        return release, src.tarball
    downloads = ctx.mkdir(ctx.cache / "downloads")
    name = release.download_url().rsplit("/", 1)[-1] or f"actions-runner-{version}.tar.gz"
    dest = downloads / f"{release.sha256[:16]}-{name}"
    if dest.is_file():
        await asyncio.to_thread(verify_runner_tarball, dest, release.sha256, version)
        return release, dest
    tmp = downloads / f".{dest.name}.part"
    ctx.log(f"runner-layer: downloading {release.download_url()}")
    await _download(release.download_url(), tmp)
    try:
        await asyncio.to_thread(verify_runner_tarball, tmp, release.sha256, version)
    except RunnerChecksumError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return release, dest


def _extract_runner(tarball: Path, dest: Path, max_bytes: int = RUNNER_MAX_BYTES) -> None:
    """Unpack the runner release into ``dest``: first read whole without writing anything
    (:func:`impvm.agent.layers.scan_layer`: no entry, hard link or relative symlink leaving
    ``dest``, no device node, no entry below a symlink of the archive, at most ``max_bytes``
    unpacked), then extracted with tarfile's ``data`` filter (no absolute paths, no links
    leaving ``dest``, no set-uid bits). Raises :class:`ImageBuildError`."""
    try:
        scan_layer(
            tarball, Budget(max_bytes), f"runner tarball {tarball.name}", through_links=False
        )
    except ImageError as exc:
        raise ImageBuildError(str(exc)) from None
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ImageBuildError(f"unpacking {tarball.name} failed: {exc}") from None
    if not (dest / "run.sh").is_file():
        raise ImageBuildError(f"{tarball.name} has no run.sh: not a GitHub Actions runner")


async def _download(url: str, dest: Path) -> None:
    import httpx

    try:
        async with (
            httpx.AsyncClient(follow_redirects=True, timeout=60.0) as http,
            http.stream("GET", url) as resp,
        ):
            resp.raise_for_status()
            with dest.open("wb") as f:
                async for chunk in resp.aiter_bytes(CHUNK):
                    f.write(chunk)
    except httpx.HTTPError as exc:
        await asyncio.to_thread(dest.unlink, missing_ok=True)
        raise ImageBuildError(f"downloading {url} failed: {type(exc).__name__}: {exc}") from None
