"""What a build is asked (:class:`BuildOptions`, :class:`RunnerSource`) and what it gives back
(:class:`BuiltImage`), the default lock and cache paths, and :class:`ImageBuildError`, which
every build step raises."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from impvm.images.spec import IMAGES

PROJECT_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_LOCK = PROJECT_ROOT / "images" / "lock.json"
DEFAULT_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "impvm" / "images"
)
#: The most a runner release may unpack to, in bytes (2.3xx releases: about 500 MB): a
#: tarball that inflates beyond is refused before anything of it is written
RUNNER_MAX_BYTES = 2 << 30


class ImageBuildError(Exception):
    """A build step failed; the message names the step (and carries the tool's error output)."""


@dataclass(frozen=True)
class RunnerSource:
    """Where ``/home/runner/actions-runner`` of the runner layer comes from.

    A GitHub Actions runner release: ``version`` and ``sha256`` (default: the lock's
    ``runner``), fetched from ``url`` (``{version}`` is replaced; default: the lock's URL, i.e.
    GitHub's release asset) or read from ``tarball``; either way its sha256 must equal ``sha256``.
    Or, for tests and the development stack, ``standin_python``: a ``run.sh`` that runs the
    GitHub stand-in's runner (``PYTHON -m impvm.devstack.standin_runner``) with that interpreter,
    which the runtime shares into the VM.
    """

    version: str | None = None
    sha256: str | None = None
    url: str | None = None
    tarball: Path | None = None
    standin_python: str | None = None


@dataclass
class BuildOptions:
    """``images``: names to build (default all); ``use_cache``: reuse tagged results (False:
    build everything again, into the same cache layout, e.g. to check reproducibility);
    ``log``: progress lines."""

    lock_path: Path = DEFAULT_LOCK
    cache_dir: Path = DEFAULT_CACHE
    runner: RunnerSource = field(default_factory=RunnerSource)
    images: tuple[str, ...] = tuple(s.name for s in IMAGES)
    update_lock: bool = False
    use_cache: bool = True
    #: the OCI layout to build into (default ``cache_dir/oci``); wheels and .deb files are
    #: always taken from ``cache_dir``
    layout_dir: Path | None = None
    #: with ``use_cache=False``: still take Debian roots already in the layout
    reuse_roots: bool = False
    project_root: Path = PROJECT_ROOT
    #: the cosign binary for the agent image (default: the pinned build, made when missing)
    cosign: Path | None = None
    #: the most the runner tarball may unpack to, in bytes
    runner_max_bytes: int = RUNNER_MAX_BYTES
    log: Callable[[str], None] = field(
        default=lambda line: print(f"images: {line}", file=sys.stderr, flush=True)
    )


@dataclass(frozen=True)
class BuiltImage:
    """A built image: ``layout``/``tag`` locate it, ``digest`` is its manifest digest
    (``sha256:<hex>``), ``size_bytes`` the sum of its compressed blobs (manifest, config, layers)
    and ``unpacked_bytes`` the sum of its layers' uncompressed sizes; ``cached``: it was there
    already."""

    name: str
    layout: Path
    tag: str
    digest: str
    size_bytes: int
    unpacked_bytes: int
    cached: bool
    #: tags (in ``layout``) of the Debian roots it was assembled from
    roots: tuple[str, ...] = ()

    @property
    def oci_ref(self) -> str:
        """The skopeo/podman reference ``oci:<layout>:<tag>``."""
        return f"oci:{self.layout}:{self.tag}"
