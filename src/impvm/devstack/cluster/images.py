"""The cluster's own small images, made with umoci from binaries build-cluster.sh built: the pod
sandbox (``pause``, kubelet's "infra" container) and CoreDNS. Each is a single layer holding one
static binary, stamped with a fixed time so the same binary gives the same digest, and pushed
to the cluster's registry; callers reference them by digest.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from impvm.agent.tools import run_tool
from impvm.images.options import ImageBuildError

#: the time every file and config of these images is stamped with (2020-01-01T00:00:00Z)
EPOCH = "2020-01-01T00:00:00Z"


async def _run(*args: str) -> bytes:
    return await run_tool(" ".join(args[:2]), *args, error=ImageBuildError)


async def binary_image(
    work: Path, registry: str, repo: str, binary: Path, entrypoint: list[str]
) -> str:
    """A one-layer image with ``binary`` at ``/<name>`` run as ``entrypoint``, pushed to
    ``registry`` (plain HTTP) as ``repo``. Returns ``registry/repo@sha256:...``. Raises
    :class:`ImageBuildError`."""
    layout, bundle = work / "oci", work / "bundle"
    await asyncio.to_thread(shutil.rmtree, work, True)
    await asyncio.to_thread(work.mkdir, parents=True)
    image = f"{layout}:latest"
    await _run("umoci", "init", "--layout", str(layout))
    await _run("umoci", "new", "--image", image)
    await _run("umoci", "unpack", "--image", image, str(bundle))
    dest = bundle / "rootfs" / binary.name
    await asyncio.to_thread(shutil.copyfile, binary, dest)
    dest.chmod(0o755)
    await _run("umoci", "repack", "--image", image, "--history.created", EPOCH, str(bundle))
    await _run(
        "umoci",
        "config",
        "--image",
        image,
        "--created",
        EPOCH,
        "--history.created",
        EPOCH,
        *(f"--config.entrypoint={a}" for a in entrypoint),
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
        f"docker://{registry}/{repo}:latest",
    )
    digest = digest_file.read_text().strip()
    await asyncio.to_thread(shutil.rmtree, bundle, True)
    return f"{registry}/{repo}@{digest}"
