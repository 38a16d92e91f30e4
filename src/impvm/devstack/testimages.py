"""Build the development/test runner images from files and push them to a (loopback) registry.

Two images follow the runner image contract (docs/images.md), shrunk to what a test needs:

* base image ``imp/runner-base``: Debian's static busybox (package ``busybox-static``) as the
  userland (``/bin/busybox`` plus one symlink per applet in ``/bin``), ``/etc/passwd`` with the
  ``runner`` user (uid/gid 10001), ``CMD ["/usr/local/bin/runner"]``;
* runner layer ``imp/runner-layer``: ``/usr/local/bin/runner`` (the reference wrapper,
  ``impvm/agent/assets/runner``) and ``/home/runner/actions-runner/run.sh``.

Images are built with ``umoci`` (init/new/unpack/repack/config) into an OCI layout and pushed with
``skopeo copy oci:... docker://HOST:PORT/...`` (plain HTTP). The functions return references
pinned by digest (OCI distribution spec), e.g.
``127.0.0.1:5000/imp/runner-base@sha256:...``.

Example::

    async with LocalRegistry() as reg:
        images = await build_test_images(tmp_path, reg.address, run_sh="#!/bin/sh\\nexit 0\\n")
        images.base, images.runner_layer
"""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from impvm.agent.tools import run_tool
from impvm.images.runner_inputs import runner_wrapper_script, standin_run_sh

RUNNER_UID = 10001
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageBuildError(Exception):
    """A build or push step failed (the message names the command and carries its stderr)."""


@dataclass(frozen=True)
class TestImages:
    """Digest-pinned references of the pushed base image and runner layer image."""

    __test__ = False  # not a pytest test class

    base: str
    runner_layer: str


async def _run(*args: str) -> bytes:
    return await run_tool(" ".join(args[:2]), *args, error=ImageBuildError)


def _write(path: Path, data: bytes | str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)


def _populate_base(rootfs: Path, busybox: Path, applets: list[str]) -> None:
    for d in ("bin", "etc", "usr/local/bin", "proc", "dev", "sys", "home/runner/_work", "root"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    tmp = rootfs / "tmp"
    tmp.mkdir(exist_ok=True)
    os.chmod(tmp, 0o1777)  # noqa: S103 - /tmp of the image
    shutil.copy2(busybox, rootfs / "bin/busybox")
    os.chmod(rootfs / "bin/busybox", 0o755)  # noqa: S103 - an executable of the image
    for applet in applets:
        link = rootfs / "bin" / applet
        if applet != "busybox" and "/" not in applet and not link.exists():
            link.symlink_to("busybox")
    _write(
        rootfs / "etc/passwd",
        "root:x:0:0:root:/root:/bin/sh\n"
        f"runner:x:{RUNNER_UID}:{RUNNER_UID}:runner:/home/runner:/bin/sh\n",
        0o644,
    )
    _write(rootfs / "etc/group", f"root:x:0:\nrunner:x:{RUNNER_UID}:\n", 0o644)
    if os.geteuid() == 0:
        for d in ("home/runner", "home/runner/_work"):
            os.chown(rootfs / d, RUNNER_UID, RUNNER_UID)


def _populate_layer(rootfs: Path, run_sh: str | bytes) -> None:
    _write(rootfs / "usr/local/bin/runner", runner_wrapper_script(), 0o755)
    _write(rootfs / "home/runner/actions-runner/run.sh", run_sh, 0o755)


async def _build_and_push(
    work: Path,
    registry: str,
    repo: str,
    tag: str,
    populate: tuple[str, ...],
    run_sh: str | bytes = b"",
    busybox: Path = Path("/bin/busybox"),
) -> str:
    """umoci-build a one-layer image in ``work``, push it, return ``registry/repo@digest``."""
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    layout = work / "oci"
    bundle = work / "bundle"
    shutil.rmtree(layout, ignore_errors=True)
    shutil.rmtree(bundle, ignore_errors=True)
    image = f"{layout}:{tag}"
    rootless = ["--rootless"] if os.geteuid() != 0 else []
    await _run("umoci", "init", "--layout", str(layout))
    await _run("umoci", "new", "--image", image)
    await _run("umoci", "unpack", *rootless, "--image", image, str(bundle))
    rootfs = bundle / "rootfs"
    if "base" in populate:
        applets = (await _run(str(busybox), "--list")).decode().split()
        await asyncio.to_thread(_populate_base, rootfs, busybox, applets)
    if "layer" in populate:
        await asyncio.to_thread(_populate_layer, rootfs, run_sh)
    await _run("umoci", "repack", "--image", image, str(bundle))
    await _run(
        "umoci",
        "config",
        "--image",
        image,
        "--config.cmd",
        "/usr/local/bin/runner",
        "--config.env",
        f"PATH={_PATH}",
        "--config.workingdir",
        "/home/runner",
    )
    await _run("umoci", "gc", "--layout", str(layout))
    digest_file = work / "digest"
    await _run(
        "skopeo",
        "copy",
        "--quiet",
        "--dest-tls-verify=false",
        "--digestfile",
        str(digest_file),
        f"oci:{image}",
        f"docker://{registry}/{repo}:{tag}",
    )
    digest = digest_file.read_text().strip()
    shutil.rmtree(bundle, ignore_errors=True)
    return f"{registry}/{repo}@{digest}"


async def build_base_image(
    work: Path,
    registry: str,
    *,
    repo: str = "imp/runner-base",
    tag: str = "test",
    busybox: Path = Path("/bin/busybox"),
) -> str:
    """Build the busybox base image under ``work`` and push it to ``registry`` (``host:port``,
    plain HTTP) as ``repo:tag``. Returns the reference pinned by digest. Raises
    :class:`ImageBuildError`."""
    return await _build_and_push(work, registry, repo, tag, ("base",), busybox=busybox)


async def build_runner_layer_image(
    work: Path,
    registry: str,
    *,
    run_sh: str | bytes | None = None,
    repo: str = "imp/runner-layer",
    tag: str = "test",
) -> str:
    """Build the runner layer image (wrapper + ``run.sh``; ``run_sh`` defaults to
    :func:`standin_run_sh`) under ``work`` and push it. Returns the reference pinned by digest.
    Raises :class:`ImageBuildError`."""
    script = standin_run_sh() if run_sh is None else run_sh
    return await _build_and_push(work, registry, repo, tag, ("layer",), run_sh=script)


async def build_test_images(
    work: Path, registry: str, *, run_sh: str | bytes | None = None, layer_tag: str = "test"
) -> TestImages:
    """Build and push both images (in ``work/base`` and ``work/layer-<layer_tag>``)."""
    base = await build_base_image(work / "base", registry)
    layer = await build_runner_layer_image(
        work / f"layer-{layer_tag}", registry, run_sh=run_sh, tag=layer_tag
    )
    return TestImages(base=base, runner_layer=layer)
