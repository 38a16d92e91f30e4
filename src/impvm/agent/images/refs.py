"""Image references and digests (:mod:`impvm.agent.images`): the distribution project's
reference grammar, pinned ``REPO@sha256:<64 hex>`` references, and loopback registries."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from impvm.agent.runtime import ImageError

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# the distribution project's reference grammar (reference/regexp.go)
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_HOST_COMPONENT}(?:\.{_HOST_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
_NAME_RE = re.compile(rf"^(?:{_HOST}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_TAG_RE = re.compile(r"^\w[\w.-]{0,127}$")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: ``name`` (``registry/repo``, without tag or digest), ``tag`` and
    ``digest`` (``sha256:<hex>``), each optional but not both missing."""

    name: str
    tag: str | None
    digest: str | None

    @property
    def registry(self) -> str:
        """The registry host (``host[:port]``); ``docker.io`` when the name has no host part."""
        first, sep, _ = self.name.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            return first
        return "docker.io"

    @property
    def pinned(self) -> str:
        """``name@digest``; raises :class:`ImageError` when there is no digest."""
        if self.digest is None:
            raise ImageError(f"image reference {self.name!r} is not pinned by digest")
        return f"{self.name}@{self.digest}"


def parse_reference(ref: str) -> ImageRef:
    """Parse ``[registry/]repo[:tag][@sha256:<64 hex>]``.

    The name and tag must follow the grammar of the distribution project's image references
    (``reference/reference.go``: lower-case path components, a host with an optional port, a
    tag of word characters, dots and dashes): so a reference can never look like an option
    (``-v``, ``--key=...``) to a tool it is handed to. A reference with neither tag nor digest
    means tag ``latest`` (and is therefore unpinned). Raises :class:`ImageError` for an empty or
    malformed reference or a malformed digest (only ``sha256`` digests are accepted).
    """
    ref = ref.strip()
    if not ref or any(c.isspace() for c in ref):
        raise ImageError(f"invalid image reference {ref!r}")
    name, at, digest = ref.partition("@")
    if at and not _DIGEST_RE.match(digest):
        raise ImageError(f"invalid digest in image reference {ref!r} (want sha256:<64 hex>)")
    tag: str | None = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
    if not _NAME_RE.match(name) or (tag is not None and not _TAG_RE.match(tag)):
        raise ImageError(
            f"invalid image reference {ref!r} (want [host[:port]/]path[:tag][@sha256:<hex>], "
            "path in lower case)"
        )
    if not at and tag is None:
        tag = "latest"
    return ImageRef(name=name, tag=tag, digest=digest if at else None)


def _is_loopback(registry: str) -> bool:
    host = registry
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
