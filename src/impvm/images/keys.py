"""The cache keys of the build: :func:`input_key` over any inputs, :func:`root_key` of a Debian
root. Every string that goes into a key is part of it: changing one rebuilds what it keys."""

from __future__ import annotations

import hashlib

from impvm.images.lock import Lock, RootLock, requirements_with_hashes
from impvm.images.spec import MMDEBSTRAP_OPTIONS, root_spec

#: Bump when the build recipe changes in a way the lock does not show (it is part of every key).
RECIPE_VERSION = "1"


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
