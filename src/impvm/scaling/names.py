"""Names the pool controller gives: VMs (= runner names) and JIT Secrets (the template hash is
:func:`impvm.api.vm.template_hash`).

Rules and their sources:

* A runner name is at most 64 characters: GitHub answers 422 to a longer JIT request name
  (REST "Self-hosted runners", create configuration for a just-in-time runner: ``name``).
* A VM's runner registers under the VM's name, ``<pool part>-<uid[:5]>-<6 hex>``. The pool part
  is the pool's name cut to 51 characters (without a trailing ``-`` or ``.``, so the name stays
  a DNS-1123 subdomain), so the whole name is at most 64. The uid part keeps pools with equal
  or overlapping names (in one namespace or in two) from claiming each other's runners (GARM:
  only ever touch runners this installation created).
* A runner belongs to a pool when its name starts with the pool's prefix, unless the rest
  itself ends like another pool's runner name (``<uid[:5]>-<6 hex>``): the prefix ``ci-0a1b2-``
  of pool ``ci`` is not the owner of ``ci-0a1b2-3c4d5-123456``, a runner of a pool named
  ``ci-0a1b2``. Anything else with the prefix (say a registration left by a crashed pass) is the
  pool's to clean up.
"""

from __future__ import annotations

import re

#: GitHub's limit on a runner name (characters).
MAX_RUNNER_NAME = 64
#: Length of the random suffix (hex digits) of a VM name.
SUFFIX_LEN = 6
#: Characters of the pool uid (without dashes) in the prefix.
UID_LEN = 5
#: Longest pool part of a runner name.
MAX_POOL_PART = MAX_RUNNER_NAME - SUFFIX_LEN - UID_LEN - 2

_SUFFIX = re.compile(rf"[0-9a-f]{{{SUFFIX_LEN}}}")
#: The end of a runner name of a pool whose name starts with another pool's prefix.
_OTHER_POOL = re.compile(rf"(^|-)[0-9a-f]{{{UID_LEN}}}-[0-9a-f]{{{SUFFIX_LEN}}}$")


def runner_prefix(pool_name: str, pool_uid: str) -> str:
    """Name prefix of every VM (and so every runner) of one pool: ``<pool part>-<uid[:5]>-``
    (at most 58 characters; see the module docstring)."""
    part = pool_name[:MAX_POOL_PART].rstrip("-.")
    return f"{part}-{pool_uid.replace('-', '')[:UID_LEN]}-"


def vm_name(prefix: str, suffix: str) -> str:
    """The name of a new VM: ``prefix`` plus six hex digits. Raises ValueError otherwise."""
    if not _SUFFIX.fullmatch(suffix):
        raise ValueError(f"VM name suffix must be {SUFFIX_LEN} lowercase hex digits")
    return prefix + suffix


def owns_runner_name(prefix: str, name: str) -> bool:
    """Whether a runner (or VM) called ``name`` is one of the pool's with ``prefix`` (see the
    module docstring)."""
    return name.startswith(prefix) and _OTHER_POOL.search(name[len(prefix) :]) is None


def secret_name(vm: str) -> str:
    """Deterministic name of a VM's JIT Secret, so a crash between writing the Secret and
    recording it on the VM is repaired by the next pass."""
    return f"{vm}-jit"
