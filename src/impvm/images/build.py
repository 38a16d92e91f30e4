"""Build the images of :mod:`impvm.images.spec` into an OCI layout, cached by their inputs.

Tools (Debian packages): ``mmdebstrap`` makes each Debian root (``--variant=minbase``, no
recommends, no documentation, man pages or locales, apt lists and caches removed, every timestamp
clamped to the lock's ``SOURCE_DATE_EPOCH``: bit-identical tarballs for the same package set);
``umoci`` adds layers verbatim (``raw add-layer``) and writes the image config with fixed
timestamps; ``skopeo`` copies images out (another OCI layout, a registry). Python wheels come from
PyPI through ``pip download --require-hashes`` (the lock's sha256 of each file); the impvm package
is built from the source tree with ``pip wheel``. Layers that are not a Debian root (the impvm
package, the runner layer) are tarballs written here with sorted entries, fixed owners, modes
normalised to 0755/0644 and clamped mtimes.

Cache (``~/.cache/impvm/images`` by default): one OCI layout ``oci/`` whose tags are
``<image>-<key>`` (``key``: :func:`impvm.images.keys.input_key` over everything that goes into the
image), plus ``debs/<root>/`` (the .deb files of each root, so a rebuild does not download them
again), ``wheels/`` and ``downloads/`` (runner tarballs, kept only once their sha256 matched).
A build whose key is already tagged does nothing; older tags of the same image are removed and
their blobs garbage-collected. Builds on one machine are serialised by a lock file.

A Debian root whose installed packages differ from the lock fails with the list of differences
(the archive moved: the inputs changed) unless ``update_lock`` is set, which records the new
versions (and wheels) in the lock file instead.

Requires root (mmdebstrap's ``root`` mode uses ``chroot``).

This module holds the entry points (:class:`Builder`, :func:`build_images`, :func:`copy_image`);
the phases are :mod:`.roots` (Debian roots), :mod:`.wheels`, :mod:`.layers` (the impvm package,
cosign, the runner layer, with :mod:`.runner_release`) and :mod:`.assemble` (the images), over
:mod:`.context` (the run's state and the layout) and :mod:`.tarballs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from impvm.agent.tools import run_tool
from impvm.images.assemble import assemble_image
from impvm.images.context import BuildContext
from impvm.images.lock import load_lock
from impvm.images.options import BuildOptions, BuiltImage, ImageBuildError
from impvm.images.spec import IMAGES, image_spec


class Builder(BuildContext):
    """One build run (see the module docstring). ``await Builder(opts).run()``."""

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        self.cache.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.cache / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    async def run(self) -> list[BuiltImage]:
        """Build (or reuse) every requested image; returns them in request order. Raises
        :class:`ImageBuildError` (a step failed, a checksum differs) or
        :class:`impvm.images.lock.LockError` (the lock is malformed or the build drifted)."""
        for name in self.opts.images:
            try:
                image_spec(name)
            except KeyError:
                known = ", ".join(s.name for s in IMAGES)
                raise ImageBuildError(f"unknown image {name!r} (known: {known})") from None
        if os.geteuid() != 0:
            raise ImageBuildError("building images needs root (mmdebstrap uses chroot)")
        async with self._exclusive():
            self.lock = load_lock(self.opts.lock_path.read_text())
            versions = [
                (await self.tool(f"{t} --version", t, "--version")).decode().strip()
                for t in ("mmdebstrap", "umoci")
            ]
            self.tools = "\n".join(versions)
            tmp = self.mkdir(self.cache / "tmp")
            await asyncio.to_thread(_clear_stale, tmp, self.log)
            work = Path(tempfile.mkdtemp(prefix="build-", dir=tmp))
            try:
                if not (self.layout / "index.json").exists():
                    await self.tool("umoci init", "umoci", "init", "--layout", str(self.layout))
                out = [await assemble_image(self, image_spec(n), work) for n in self.opts.images]
                await self.prune([b.tag for b in out])
            finally:
                await asyncio.to_thread(shutil.rmtree, work, True)
            return out


def _clear_stale(tmp: Path, log: Callable[[str], None]) -> None:
    """Remove work directories an interrupted build left in ``tmp`` (builds hold the cache lock,
    so none is in use), except one with something still mounted below it (a killed mmdebstrap's
    chroot mounts): removing that could reach the host's /dev or /proc."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    points = [line.split()[1] for line in mounts if len(line.split()) > 1]
    for d in tmp.glob("build-*"):
        if any(p == str(d) or p.startswith(f"{d}/") for p in points):
            log(f"leaving {d}: something is still mounted below it")
            continue
        shutil.rmtree(d, ignore_errors=True)


async def build_images(opts: BuildOptions) -> list[BuiltImage]:
    """Build (or reuse) the images; see :class:`Builder`."""
    return await Builder(opts).run()


async def copy_image(image: BuiltImage, dest: str, insecure: bool = False) -> str:
    """``skopeo copy`` an image to ``dest`` (a skopeo destination such as
    ``docker://HOST/REPO:TAG`` or ``oci:DIR:TAG``); returns the digest skopeo reports, which must
    be the built digest (``ImageBuildError`` otherwise)."""
    with tempfile.TemporaryDirectory() as tmp:
        digest_file = Path(tmp) / "digest"
        tls = ["--dest-tls-verify=false"] if insecure and dest.startswith("docker://") else []
        await run_tool(
            f"copying {image.name} to {dest}",
            "skopeo",
            "copy",
            "--quiet",
            "--preserve-digests",
            *tls,
            "--digestfile",
            str(digest_file),
            "--",  # neither is ever an option, whatever it looks like
            image.oci_ref,
            dest,
            error=ImageBuildError,
        )
        got = digest_file.read_text().strip()
    if got != image.digest:
        raise ImageBuildError(f"{image.name}: {dest} has digest {got}, built {image.digest}")
    return got
