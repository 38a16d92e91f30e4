"""Fixtures for the image tests: the images built once per session (through the same code as
``impvm images build``, with the stand-in runner in the runner layer) into the machine's image
cache, so a warm machine reuses them; a loopback registry holding the runner images.

The build uses a copy of the committed lock kept in the cache: when the Debian archive has moved
past a locked version (a point release or security update), the copy records the new versions
once (a warning says so) instead of failing every run; `impvm images build --update-lock` brings
the committed lock up to date."""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from impvm.devstack.registry import DEFAULT_BINARY, LocalRegistry
from impvm.images.build import build_images, copy_image
from impvm.images.options import (
    DEFAULT_CACHE,
    DEFAULT_LOCK,
    BuildOptions,
    BuiltImage,
    RunnerSource,
)

_MISSING = [t for t in ("mmdebstrap", "umoci", "skopeo", "podman") if not shutil.which(t)]
if not DEFAULT_BINARY.exists():
    _MISSING.append(str(DEFAULT_BINARY))
if _MISSING:  # scripts/setup.sh installs these: missing means a broken setup, not a skip
    pytest.fail(f"image tests need {', '.join(_MISSING)} (scripts/setup.sh)", pytrace=False)
if os.geteuid() != 0:
    pytest.fail("image tests build with mmdebstrap in root mode: run them as root", pytrace=False)


def lock_copy(cache: Path = DEFAULT_CACHE) -> Path:
    """The cache's copy of the committed lock (refreshed when the committed lock changed)."""
    cache.mkdir(parents=True, exist_ok=True)
    copy, source = cache / "test-lock.json", cache / "test-lock.source.json"
    committed = DEFAULT_LOCK.read_text()
    if not copy.exists() or not source.exists() or source.read_text() != committed:
        copy.write_text(committed)
        source.write_text(committed)
    return copy


def build_options(**kw: object) -> BuildOptions:
    """Options of the tests' builds: the stand-in runner, the lock copy, update allowed."""
    lock = lock_copy()
    opts = BuildOptions(
        lock_path=lock,
        runner=RunnerSource(standin_python=sys.executable),
        update_lock=True,
        log=lambda line: print(f"images: {line}", file=sys.stderr, flush=True),
    )
    for k, v in kw.items():
        setattr(opts, k, v)
    return opts


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def built() -> dict[str, BuiltImage]:
    """All four images, built (or taken from the cache) once per session."""
    before = lock_copy().read_text()
    images = await build_images(build_options())
    if lock_copy().read_text() != before:
        warnings.warn(
            "the Debian archive or the wheels moved past images/lock.json; run "
            "`bash scripts/build-images.sh --update-lock` and commit the lock",
            stacklevel=1,
        )
    return {i.name: i for i in images}


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def image_registry() -> AsyncIterator[LocalRegistry]:
    async with LocalRegistry() as reg:
        yield reg


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def pushed(built: dict[str, BuiltImage], image_registry: LocalRegistry) -> dict[str, str]:
    """``name -> registry/imp/name@digest`` of the runner images pushed to the registry."""
    out = {}
    for name in ("runner-base", "runner-layer"):
        repo = f"{image_registry.address}/imp/{name}"
        digest = await copy_image(built[name], f"docker://{repo}:test", insecure=True)
        out[name] = f"{repo}@{digest}"
    return out
