"""The layers that are not a Debian root, written here as reproducible tarballs: the impvm package
(a wheel built from the source tree, installed into ``PYTHON_SITE`` and compiled to byte-code),
cosign for the agent image, and the runner layer (the runner release or the stand-in's
``run.sh``, and the wrapper). Each returns its unpacked size; raises :class:`ImageBuildError`."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

from impvm.images.context import BuildContext
from impvm.images.options import ImageBuildError
from impvm.images.runner_inputs import runner_wrapper_script, standin_run_sh
from impvm.images.runner_release import unpack_runner_release
from impvm.images.spec import (
    COSIGN_PATH,
    PYTHON_SITE,
    RUNNER_HOME,
    RUNNER_UID,
    RUNNER_WRAPPER,
    VENV,
)
from impvm.images.tarballs import sha256_file, write_tree_tar
from impvm.images.wheels import pip_command
from impvm.signing.cosign import SigningError, cosign_binary


async def app_layer(ctx: BuildContext, work: Path, out: Path) -> int:
    """The impvm package (wheel built from the source tree) installed into ``PYTHON_SITE``
    plus the ``impvm`` command, as a tarball; returns its unpacked size."""
    lock = ctx.locked()
    dist = ctx.mkdir(work / "dist")
    ctx.log("impvm: building the wheel from the source tree")
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(lock.debian.source_date_epoch))
    # build from a clean copy: setuptools reuses (and would ship stale files of) an in-tree
    # build/ directory, and the checkout stays untouched
    source = work / "source"
    await asyncio.to_thread(_copy_source, ctx.opts.project_root, source)
    await ctx.tool(
        "pip wheel (impvm)",
        *pip_command(),
        "wheel",
        "--no-deps",
        "-w",
        str(dist),
        str(source),
        env=env,
    )
    stage = work / "app"
    site = stage / PYTHON_SITE.lstrip("/")
    version = importlib.metadata.version("impvm")
    # byte-code below is compiled for the image's paths; the building interpreter must be
    # CPython 3.11 like the image's (same byte-code magic number)
    if sys.version_info[:2] != (3, 11):
        raise ImageBuildError("building the impvm layer needs CPython 3.11 (the image's)")
    await ctx.tool(
        "pip install (impvm, into the layer)",
        *pip_command(),
        "install",
        "--no-deps",
        "--no-index",
        "--no-compile",
        "--find-links",
        str(dist),
        "--target",
        str(site),
        f"impvm=={version}",
    )
    # pip --target writes scripts for the building interpreter: the image gets its own
    shutil.rmtree(site / "bin", ignore_errors=True)
    for junk in site.glob("*.dist-info/direct_url.json"):
        junk.unlink()
    script = stage / VENV.lstrip("/") / "bin" / "impvm"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"#!{VENV}/bin/python\nimport sys\n\nfrom impvm.cli import app\n\nsys.exit(app())\n"
    )
    script.chmod(0o755)
    await ctx.tool(
        "compiling impvm to byte-code",
        sys.executable,
        "-m",
        "compileall",
        "-q",
        "-j0",
        "--invalidation-mode",
        "unchecked-hash",
        "-s",
        str(stage),
        "-p",
        "/",
        str(site / "impvm"),
    )
    return await asyncio.to_thread(write_tree_tar, stage, out, lock.debian.source_date_epoch)


def _copy_source(root: Path, dest: Path) -> None:
    """The files the impvm wheel is built from (``pyproject.toml``, ``README.md``, ``src/``),
    without byte-code and build metadata."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(root / name, dest / name)
    shutil.copytree(
        root / "src",
        dest / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )


async def cosign_layer(ctx: BuildContext, work: Path, out: Path) -> int:
    """``COSIGN_PATH`` (root, 0755) from ``opts.cosign`` or the pinned build; returns the
    layer's unpacked size."""
    binary = ctx.opts.cosign
    if binary is None:
        try:
            binary = await asyncio.to_thread(cosign_binary)
        except SigningError as e:
            raise ImageBuildError(f"the agent image needs cosign: {e}") from None
    if not binary.is_file():
        raise ImageBuildError(f"cosign: {binary}: no such file")
    stage = work / "cosign"
    dest = stage / COSIGN_PATH.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(shutil.copyfile, binary, dest)
    dest.chmod(0o755)
    ctx.log(f"impvm-agent: cosign {binary} (sha256 {sha256_file(dest)})")
    lock = ctx.locked()
    return await asyncio.to_thread(write_tree_tar, stage, out, lock.debian.source_date_epoch)


async def runner_layer(ctx: BuildContext, work: Path, out: Path) -> int:
    """``RUNNER_HOME`` (the runner release, or the stand-in's ``run.sh``) and ``RUNNER_WRAPPER``;
    returns the layer's unpacked size."""
    lock = ctx.locked()
    src = ctx.opts.runner
    stage = work / "runner"
    home = stage / RUNNER_HOME.lstrip("/")
    home.mkdir(parents=True)
    if src.standin_python:
        ctx.log("runner-layer: the stand-in runner (tests and development only)")
        run_sh = home / "run.sh"
        run_sh.write_text(standin_run_sh(src.standin_python))
        run_sh.chmod(0o755)
    else:
        await unpack_runner_release(ctx, home)
    wrapper = stage / RUNNER_WRAPPER.lstrip("/")
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_bytes(runner_wrapper_script())
    wrapper.chmod(0o755)

    def owner(rel: str) -> tuple[int, int]:
        if rel == "home/runner" or rel.startswith("home/runner/"):
            return RUNNER_UID, RUNNER_UID
        return 0, 0

    return await asyncio.to_thread(write_tree_tar, stage, out, lock.debian.source_date_epoch, owner)
