"""What the images are made of: the image definitions (:class:`ImageSpec`, the Debian roots'
:class:`RootSpec`, the mmdebstrap options) and the ``umoci config`` arguments of each.

Pure code. The lock that records every input is :mod:`impvm.images.lock`, the cache keys
:mod:`impvm.images.keys`; :mod:`impvm.images.build` is the shell that runs the tools.

Images (OCI, linux/amd64):

* ``runner-base``: the runner base image of the runner image contract (Debian slim with glibc,
  user ``runner`` uid/gid 10001, CA certificates, the libraries the GitHub runner's .NET runtime
  needs, ``CMD ["/usr/local/bin/runner"]``) plus the everyday tools jobs expect (git, curl, tar,
  unzip, jq). One layer.
* ``runner-layer``: ``/home/runner/actions-runner`` (the GitHub Actions runner release, checked
  against its published sha256) and the wrapper ``/usr/local/bin/runner``. One layer.
* ``impvm``: the operator (and the agent's code): Debian slim + Python 3.11 + the locked wheels in
  ``/opt/impvm`` (one layer), then the impvm package itself (a second, small layer, so a code
  change rebuilds only that). Runs as the non-root user ``impvm`` (uid/gid 10000).
* ``impvm-agent``: like ``impvm`` plus qemu, skopeo, umoci, e2fsprogs, bubblewrap, busybox (the
  guest initramfs) and a Debian guest kernel, then ``/usr/local/bin/cosign`` (sigstore's CLI at
  the version ``impvm.devstack``'s build script pins, built from its Go module: Debian has no
  cosign package, and the agent verifies signed images with it); runs as root (the agent unpacks
  images with their owners and opens ``/dev/kvm`` and ``/dev/net/tun``); the impvm layer is the
  same blob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: uid/gid of the ``runner`` user (runner image contract).
RUNNER_UID = 10001
#: uid/gid of the ``impvm`` user the operator runs as.
IMPVM_UID = 10000
#: Where the Python environment (interpreter link, wheels, the ``impvm`` command) lives.
VENV = "/opt/impvm"
PYTHON_SITE = f"{VENV}/lib/python3.11/site-packages"
RUNNER_HOME = "/home/runner/actions-runner"
RUNNER_WRAPPER = "/usr/local/bin/runner"
#: Where the agent image has cosign (on ``PATH``: ``impvm agent --cosign`` defaults to it).
COSIGN_PATH = "/usr/local/bin/cosign"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class RootSpec:
    """How a Debian root is made beyond its package list: ``users`` (name, uid; a group of the
    same id), whether the locked wheels go into a virtual environment at :data:`VENV`, and
    whether kernel initramfs images are dropped (the agent builds its own guest initramfs)."""

    name: str
    users: tuple[tuple[str, int], ...] = ()
    venv: bool = False
    drop_initrd: bool = False


@dataclass(frozen=True)
class ImageSpec:
    """An image: its layers in order (``root:<name>``, ``app`` = the impvm package layer,
    ``runner`` = the runner layer) and its OCI config."""

    name: str
    layers: tuple[str, ...]
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    workdir: str = ""
    env: tuple[str, ...] = (f"PATH={PATH}", "LANG=C.UTF-8")
    labels: dict[str, str] = field(default_factory=dict)


#: mmdebstrap options of every root (part of every root's key): Debian's minimal variant, no
#: recommends, no documentation/man pages/locales (copyright files stay), merged /usr set up the
#: way debootstrap does it (without the usrmerge package and the perl it needs).
MMDEBSTRAP_OPTIONS = (
    "--mode=root",
    "--variant=minbase",
    "--format=tar",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    "--aptopt=APT::Install-Recommends false",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/lintian/*",
)

ROOTS: tuple[RootSpec, ...] = (
    RootSpec("runner-base", users=(("runner", RUNNER_UID),)),
    RootSpec("impvm-base", users=(("impvm", IMPVM_UID),), venv=True),
    RootSpec("impvm-agent-base", users=(("impvm", IMPVM_UID),), venv=True, drop_initrd=True),
)

_PY_ENV = (
    f"PATH={VENV}/bin:{PATH}",
    "LANG=C.UTF-8",
    "PYTHONUNBUFFERED=1",
    "PYTHONDONTWRITEBYTECODE=1",
)

IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(
        "runner-base",
        ("root:runner-base",),
        cmd=(RUNNER_WRAPPER,),
        workdir="/home/runner",
    ),
    ImageSpec("runner-layer", ("runner",), cmd=(RUNNER_WRAPPER,), workdir="/home/runner"),
    ImageSpec(
        "impvm",
        ("root:impvm-base", "app"),
        user=f"{IMPVM_UID}:{IMPVM_UID}",
        entrypoint=(f"{VENV}/bin/impvm",),
        cmd=("operator",),
        env=_PY_ENV,
    ),
    ImageSpec(
        "impvm-agent",
        ("root:impvm-agent-base", "cosign", "app"),
        user="0:0",
        entrypoint=(f"{VENV}/bin/impvm",),
        cmd=("agent",),
        env=_PY_ENV,
    ),
)

ImageName = Literal["runner-base", "runner-layer", "impvm", "impvm-agent"]


def image_spec(name: str) -> ImageSpec:
    """The :class:`ImageSpec` called ``name``; ``KeyError`` when there is none."""
    for spec in IMAGES:
        if spec.name == name:
            return spec
    raise KeyError(name)


def root_spec(name: str) -> RootSpec:
    """The :class:`RootSpec` called ``name``; ``KeyError`` when there is none."""
    for spec in ROOTS:
        if spec.name == name:
            return spec
    raise KeyError(name)


def image_config_args(spec: ImageSpec, created: str) -> list[str]:
    """``umoci config`` arguments for ``spec`` (``created``: RFC 3339, the clamp time)."""
    args = [
        "--created",
        created,
        "--history.created",
        created,
        "--architecture",
        "amd64",
        "--os",
        "linux",
    ]
    if spec.user:
        args += ["--config.user", spec.user]
    for e in spec.env:
        args += ["--config.env", e]
    for e in spec.entrypoint:
        args += ["--config.entrypoint", e]
    for c in spec.cmd:
        args += ["--config.cmd", c]
    if spec.workdir:
        args += ["--config.workingdir", spec.workdir]
    for k, v in sorted(spec.labels.items()):
        args += ["--config.label", f"{k}={v}"]
    return args
