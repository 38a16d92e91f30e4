"""What the images are made of: the image definitions and the lock that records every input.

Pure code: no I/O beyond parsing text handed in. :mod:`impvm.images.build` is the shell that runs
the tools.

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

The lock (``images/lock.json`` in the repository) records the Debian sources, suite and every
package version installed in each Debian root, the wheels (file name and sha256, versions from
``constraints.txt``), the ``SOURCE_DATE_EPOCH`` every timestamp is clamped to, and the default
GitHub runner release (version, sha256, URL). A build from the same lock gives the same digests.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
#: Bump when the build recipe changes in a way the lock does not show (it is part of every key).
RECIPE_VERSION = "1"

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_VERSION_RE = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+$")


class LockError(ValueError):
    """The lock file is malformed, or a build's result differs from it."""


class DebianInputs(BaseModel):
    """The Debian side: ``suite``, apt ``sources`` (one-line ``deb URI SUITE COMPONENTS`` each;
    a ``snapshot.debian.org`` URI makes the package set immutable), ``source_date_epoch``
    (seconds since 1970, the clamp for every timestamp in every layer)."""

    model_config = ConfigDict(extra="forbid")

    suite: str
    sources: list[str] = Field(min_length=1)
    source_date_epoch: int = Field(gt=0)


class RootLock(BaseModel):
    """One Debian root: ``include`` (packages asked for; their dependencies come along, no
    recommends) and ``packages`` (``name -> version`` of every package installed, as
    ``dpkg-query`` reports them)."""

    model_config = ConfigDict(extra="forbid")

    include: list[str] = Field(min_length=1)
    packages: dict[str, str] = Field(default_factory=dict)


class WheelLock(BaseModel):
    """A Python wheel: ``file`` (its name on PyPI), ``sha256`` (hex)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    version: str
    file: str
    sha256: str

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _SHA256_RE.match(v):
            raise ValueError("sha256 must be 64 lower-case hex digits")
        return v


class RunnerRelease(BaseModel):
    """The GitHub Actions runner release the runner layer ships by default: ``version``
    (``X.Y.Z``), ``sha256`` (hex, as published in the release notes for
    ``actions-runner-linux-x64-X.Y.Z.tar.gz``), ``url`` (``{version}`` is replaced)."""

    model_config = ConfigDict(extra="forbid")

    version: str
    sha256: str
    url: str = (
        "https://github.com/actions/runner/releases/download/v{version}/"
        "actions-runner-linux-x64-{version}.tar.gz"
    )

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not _VERSION_RE.match(v):
            raise ValueError("version must look like 2.329.0")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = v.lower().removeprefix("sha256:")
        if not _SHA256_RE.match(v):
            raise ValueError("sha256 must be 64 hex digits")
        return v

    def download_url(self) -> str:
        """``url`` with the version filled in."""
        return self.url.replace("{version}", self.version)


class Lock(BaseModel):
    """The whole lock file (``images/lock.json``)."""

    model_config = ConfigDict(extra="forbid")

    debian: DebianInputs
    roots: dict[str, RootLock]
    wheels: list[WheelLock]
    runner: RunnerRelease


def load_lock(text: str) -> Lock:
    """Parse the lock file's JSON text. Raises :class:`LockError` naming the bad field."""
    from pydantic import ValidationError

    try:
        lock = Lock.model_validate_json(text)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise LockError(f"image lock: {where}: {err['msg']}") from None
    missing = [r.name for r in ROOTS if r.name not in lock.roots]
    if missing:
        raise LockError(f"image lock: roots.{missing[0]}: missing")
    return lock


def dump_lock(lock: Lock) -> str:
    """The lock as stable, sorted, indented JSON (one trailing newline)."""
    import json

    data = lock.model_dump()
    data["wheels"] = sorted(data["wheels"], key=lambda w: w["name"].lower())
    for root in data["roots"].values():
        root["packages"] = dict(sorted(root["packages"].items()))
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


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


def parse_dpkg_list(text: str) -> dict[str, str]:
    """``name -> version`` from ``dpkg-query -W -f '${Package} ${Version}\\n'`` output."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[0]] = parts[1]
    return out


def package_drift(locked: dict[str, str], installed: dict[str, str]) -> list[str]:
    """What differs between the lock and a build, one line per package (sorted):
    ``"NAME: locked A, built B"``, ``"NAME: built B, not in the lock"``,
    ``"NAME: locked A, not built"``. Empty when they agree."""
    out = []
    for name in sorted(set(locked) | set(installed)):
        a, b = locked.get(name), installed.get(name)
        if a == b:
            continue
        if a is None:
            out.append(f"{name}: built {b}, not in the lock")
        elif b is None:
            out.append(f"{name}: locked {a}, not built")
        else:
            out.append(f"{name}: locked {a}, built {b}")
    return out


def requirements_with_hashes(wheels: list[WheelLock], exclude: tuple[str, ...] = ()) -> str:
    """A pip requirements file pinning every wheel by version and sha256 (``--require-hashes``
    mode), without the names in ``exclude``."""
    skip = {_norm(n) for n in exclude}
    lines = [
        f"{w.name}=={w.version} --hash=sha256:{w.sha256}"
        for w in sorted(wheels, key=lambda w: _norm(w.name))
        if _norm(w.name) not in skip
    ]
    return "".join(f"{ln}\n" for ln in lines)


def parse_constraints(text: str) -> dict[str, str]:
    """``normalised name -> version`` of the ``NAME==VERSION`` lines of a constraints file."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        name, sep, version = line.partition("==")
        if sep:
            out[_norm(name)] = version.strip()
    return out


def wheels_follow_constraints(
    wheels: list[WheelLock], constraints: dict[str, str], direct: list[str]
) -> bool:
    """Whether the locked wheels still are what ``constraints`` (from :func:`parse_constraints`)
    pins: every locked wheel but pip at its pinned version, and every direct dependency
    (``direct``: requirement names) locked. A changed pin of any wheel, direct or not, makes this
    false; a new transitive dependency only comes with a changed pin of its parent."""
    locked = {_norm(w.name): w.version for w in wheels}
    for name, version in locked.items():
        if name != _PIP_NAME and constraints.get(name) != version:
            return False
    return all(_norm(d) in locked for d in direct) and _PIP_NAME in locked


_PIP_NAME = "pip"


def wheel_from_file(filename: str, sha256: str) -> WheelLock:
    """A :class:`WheelLock` from a wheel's file name (``NAME-VERSION-...whl``, PEP 427)."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5 or not filename.endswith(".whl"):
        raise LockError(f"not a wheel file name: {filename!r}")
    return WheelLock(name=parts[0], version=parts[1], file=filename, sha256=sha256)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def input_key(*parts: str | bytes) -> str:
    """The cache key of a set of inputs: hex sha256 over the length-prefixed parts (so no two
    different part lists collide by concatenation), starting with :data:`RECIPE_VERSION`."""
    h = hashlib.sha256()
    for part in (RECIPE_VERSION, *parts):
        b = part.encode() if isinstance(part, str) else part
        h.update(len(b).to_bytes(8, "big"))
        h.update(b)
    return h.hexdigest()


def root_key(lock: Lock, root: str, hook: str) -> str:
    """The key of a Debian root: the Debian inputs, the root's include list and locked
    packages, the wheels (for a root with a virtual environment) and the hook script."""
    spec = root_spec(root)
    r = lock.roots[root]
    parts = [
        "\n".join(MMDEBSTRAP_OPTIONS),
        lock.debian.model_dump_json(),
        RootLock(include=r.include, packages=dict(sorted(r.packages.items()))).model_dump_json(),
        hook,
    ]
    if spec.venv:
        parts.append(requirements_with_hashes(lock.wheels))
    return input_key(*parts)


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
