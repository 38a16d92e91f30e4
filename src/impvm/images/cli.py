"""``impvm images build``: build the images, optionally copy them to an OCI layout and push them
to a registry, and print each image's digest (see :mod:`impvm.images.build`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from impvm.images.build import build_images, copy_image
from impvm.images.lock import LockError
from impvm.images.options import (
    DEFAULT_CACHE,
    DEFAULT_LOCK,
    BuildOptions,
    BuiltImage,
    ImageBuildError,
    RunnerSource,
)
from impvm.images.spec import IMAGES

images_app = typer.Typer(help="Build the OCI images from Debian packages.", no_args_is_help=True)


async def _build_and_ship(
    opts: BuildOptions,
    out: Path | None,
    push: str | None,
    repo_prefix: str,
    insecure: bool,
) -> list[tuple[BuiltImage, str | None]]:
    built = await build_images(opts)
    shipped: list[tuple[BuiltImage, str | None]] = []
    for image in built:
        if out is not None:
            await copy_image(image, f"oci:{out}:{image.name}")
        ref = None
        if push:
            repo = f"{push.rstrip('/')}/{repo_prefix.strip('/')}/{image.name}".replace("//", "/")
            digest = await copy_image(image, f"docker://{repo}:{image.tag}", insecure=insecure)
            ref = f"{repo}@{digest}"
        shipped.append((image, ref))
    return shipped


@images_app.command("build")
def build(
    images: Annotated[
        list[str] | None,
        typer.Argument(help=f"Images to build (default all: {', '.join(s.name for s in IMAGES)})."),
    ] = None,
    push: Annotated[
        str | None, typer.Option(help="Push to this registry (HOST[:PORT][/PATH]) with skopeo.")
    ] = None,
    repo_prefix: Annotated[str, typer.Option(help="Repository path under the registry.")] = "imp",
    insecure_registry: Annotated[
        bool, typer.Option(help="Push over plain HTTP / without TLS verification (loopback).")
    ] = False,
    out: Annotated[
        Path | None, typer.Option(help="Also copy the images into this OCI layout (tag = name).")
    ] = None,
    lock: Annotated[Path, typer.Option(help="The lock file.")] = DEFAULT_LOCK,
    cache_dir: Annotated[Path, typer.Option(help="Build cache.")] = DEFAULT_CACHE,
    runner_version: Annotated[
        str | None, typer.Option(help="GitHub Actions runner release (default: the lock's).")
    ] = None,
    runner_sha256: Annotated[
        str | None, typer.Option(help="Its published sha256 (linux-x64 tarball).")
    ] = None,
    runner_url: Annotated[
        str | None, typer.Option(help="Download URL ({version} is replaced).")
    ] = None,
    runner_tarball: Annotated[
        Path | None, typer.Option(help="Use this runner tarball instead of downloading it.")
    ] = None,
    standin_runner: Annotated[
        bool,
        typer.Option(help="Runner layer with the GitHub stand-in's runner (tests/development)."),
    ] = False,
    cosign: Annotated[
        Path | None,
        typer.Option(help="cosign binary for the agent image (default: the pinned build)."),
    ] = None,
    update_lock: Annotated[
        bool, typer.Option(help="Record new Debian package versions and wheels in the lock.")
    ] = False,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Rebuild even when the inputs are cached.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = (
        False
    ),
) -> None:
    """Build the images (cached by their inputs) and print NAME DIGEST SIZE [PUSHED REFERENCE].
    Exit 2 on a bad lock, a build that differs from the lock, or a runner checksum mismatch."""
    import sys

    source = RunnerSource(
        version=runner_version,
        sha256=runner_sha256,
        url=runner_url,
        tarball=runner_tarball,
        standin_python=sys.executable if standin_runner else None,
    )
    opts = BuildOptions(
        lock_path=lock,
        cache_dir=cache_dir,
        runner=source,
        images=tuple(images or [s.name for s in IMAGES]),
        update_lock=update_lock,
        use_cache=not no_cache,
        cosign=cosign,
    )
    try:
        shipped = asyncio.run(_build_and_ship(opts, out, push, repo_prefix, insecure_registry))
    except (LockError, ImageBuildError, OSError) as exc:
        typer.echo(f"impvm images build: {exc}", err=True)
        raise typer.Exit(code=2) from None
    if as_json:
        doc = {
            img.name: {
                "digest": img.digest,
                "size_bytes": img.size_bytes,
                "unpacked_bytes": img.unpacked_bytes,
                "oci": img.oci_ref,
                "pushed": ref,
            }
            for img, ref in shipped
        }
        typer.echo(json.dumps(doc, indent=1))
        return
    for img, ref in shipped:
        size = f"{_human(img.size_bytes)} ({_human(img.unpacked_bytes)} unpacked)"
        typer.echo(" ".join(x for x in (img.name, img.digest, size, ref) if x))


def _human(n: int) -> str:
    """Bytes as MiB with one decimal, or KiB below 1 MiB."""
    return f"{n / (1 << 20):.1f}MiB" if n >= 1 << 20 else f"{n / 1024:.1f}KiB"
