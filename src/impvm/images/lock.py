"""The lock of every input of the images: :class:`Lock` (read by :func:`load_lock`, written by
:func:`dump_lock`) and the pure checks of a build against it (package drift, wheels against
``constraints.txt``, hash-pinned requirements). Raises :class:`LockError`.

Pure code: no I/O beyond parsing text handed in.

The lock (``images/lock.json`` in the repository) records the Debian sources, suite and every
package version installed in each Debian root, the wheels (file name and sha256, versions from
``constraints.txt``), the ``SOURCE_DATE_EPOCH`` every timestamp is clamped to, and the default
GitHub runner release (version, sha256, URL). A build from the same lock gives the same digests.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from impvm.images.spec import ROOTS

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
