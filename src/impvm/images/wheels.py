"""The locked Python wheels: downloaded into ``cache/wheels`` by ``pip download --require-hashes``
(each checked against the lock's sha256), with a hash-pinned ``requirements.txt``; with
``update_lock``, resolved anew under ``constraints.txt`` and recorded in the lock. Raises
:class:`ImageBuildError`."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from impvm.images.context import BuildContext
from impvm.images.lock import (
    WheelLock,
    parse_constraints,
    requirements_with_hashes,
    wheel_from_file,
    wheels_follow_constraints,
)
from impvm.images.options import ImageBuildError
from impvm.images.tarballs import sha256_file

#: pip's own wheel (run from the wheel file inside the Debian root to install the others)
PIP = "pip"


def pip_command() -> list[str]:
    """The building interpreter's pip, quiet."""
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


#: wheels for Debian 12's CPython 3.11 on x86-64 (glibc 2.36): pip takes the platform tags
#: literally, so every compatible manylinux tag is listed
_PLATFORM = (
    "--only-binary=:all:",
    "--implementation",
    "cp",
    "--python-version",
    "3.11",
    "--abi",
    "cp311",
    *(
        a
        for tag in [f"manylinux_2_{m}_x86_64" for m in range(36, 4, -1)]
        + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
        for a in ("--platform", tag)
    ),
)


async def locked_wheels(ctx: BuildContext) -> Path:
    """The locked wheels in ``cache/wheels`` (downloaded when missing, each checked against
    its sha256) and a hash-pinned ``requirements.txt`` of all but pip. With
    ``update_lock``: resolve the runtime dependencies of impvm under ``constraints.txt``
    first and record them."""
    lock = ctx.locked()
    wheels = ctx.mkdir(ctx.cache / "wheels")
    if ctx.opts.update_lock and not ctx.wheels_checked:
        ctx.wheels_checked = True
        constraints = (ctx.opts.project_root / "constraints.txt").read_text()
        direct = [re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in _runtime_requirements()]
        if not wheels_follow_constraints(lock.wheels, parse_constraints(constraints), direct):
            await _resolve_wheels(ctx, wheels)
    missing = [
        w
        for w in lock.wheels
        if not (wheels / w.file).is_file() or sha256_file(wheels / w.file) != w.sha256
    ]
    if missing:
        ctx.log(f"downloading {len(missing)} wheels")
        req = wheels / "download.txt"
        req.write_text(requirements_with_hashes(missing))
        await ctx.tool(
            "pip download",
            *pip_command(),
            "download",
            "--no-deps",
            "--require-hashes",
            *_PLATFORM,
            "-d",
            str(wheels),
            "-r",
            str(req),
        )
        for w in missing:
            if sha256_file(wheels / w.file) != w.sha256:
                raise ImageBuildError(f"{w.file}: sha256 differs from the lock")
    (wheels / "requirements.txt").write_text(requirements_with_hashes(lock.wheels, (PIP,)))
    return wheels


async def _resolve_wheels(ctx: BuildContext, wheels: Path) -> None:
    lock = ctx.locked()
    deps = _runtime_requirements()
    pip_version = importlib.metadata.version("pip")
    tmp = Path(tempfile.mkdtemp(dir=wheels))
    try:
        await ctx.tool(
            "pip download (resolving the wheels)",
            *pip_command(),
            "download",
            *_PLATFORM,
            "-c",
            str(ctx.opts.project_root / "constraints.txt"),
            "-d",
            str(tmp),
            f"pip=={pip_version}",
            *deps,
        )
        found = await asyncio.to_thread(_collect_wheels, tmp, wheels)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if sorted(w.model_dump_json() for w in found) != sorted(
        w.model_dump_json() for w in lock.wheels
    ):
        lock.wheels = found
        ctx.record_lock()


def _collect_wheels(tmp: Path, wheels: Path) -> list[WheelLock]:
    """Move the wheels pip downloaded into ``tmp`` to ``wheels``; returns their lock entries."""
    found = []
    for f in sorted(tmp.glob("*.whl")):
        found.append(wheel_from_file(f.name, sha256_file(f)))
        os.replace(f, wheels / f.name)
    return found


def _runtime_requirements() -> list[str]:
    """impvm's runtime requirements (no extras), as its installed metadata lists them."""
    reqs = importlib.metadata.requires("impvm") or []
    return [r for r in reqs if "extra" not in r.partition(";")[2]]
