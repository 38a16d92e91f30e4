"""Cgroups of the test cluster: one subtree per cluster (``impvm-cluster-<token>``) in every
mounted hierarchy (cgroup v1 controllers and the v2 unified one), so each kubelet's
``cgroupRoot``, each node's runtime processes (containerd and the shims it forks) and the control
plane sit where one walk finds, kills and removes them, even after a crashed run.

Paths are relative to a hierarchy's mount point (``impvm-cluster-ab12/node-1``). Needs root.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

MOUNTS = Path("/proc/self/mounts")


def hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, named v1 hierarchies, v2)."""
    out: list[Path] = []
    for line in MOUNTS.read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] in ("cgroup", "cgroup2"):
            p = Path(fields[1])
            if p not in out:
                out.append(p)
    return out


def create(rel: str) -> None:
    """Make ``rel`` (and its parents) in every hierarchy. A v1 cpuset child starts with no CPUs
    or memory nodes, so each new cpuset directory copies its parent's."""
    for h in hierarchies():
        parts = Path(rel).parts
        for i in range(1, len(parts) + 1):
            d = h.joinpath(*parts[:i])
            if d.is_dir():
                continue
            d.mkdir()
            for knob in ("cpuset.cpus", "cpuset.mems"):
                src = d.parent / knob
                if (d / knob).exists() and src.exists():
                    (d / knob).write_text(src.read_text().strip() or "\n")


def procs_files(rel: str) -> list[Path]:
    """``cgroup.procs`` of ``rel`` in every hierarchy where it exists."""
    return [h / rel / "cgroup.procs" for h in hierarchies() if (h / rel).is_dir()]


def pids(rel: str) -> set[int]:
    """Every process in ``rel`` and its descendants, in every hierarchy."""
    found: set[int] = set()
    for h in hierarchies():
        top = h / rel
        if not top.is_dir():
            continue
        for dirpath, _dirs, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):
                    found.update(
                        int(x) for x in (Path(dirpath) / "cgroup.procs").read_text().split()
                    )
    return found


def kill(rel: str, timeout: float = 30.0) -> None:
    """SIGKILL every process in ``rel`` and its descendants (every hierarchy) until none is left
    or ``timeout`` seconds passed; raises ``RuntimeError`` naming the survivors then."""
    deadline = time.monotonic() + timeout
    while left := pids(rel):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes left in cgroup {rel}: {sorted(left)}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove(rel: str, timeout: float = 30.0) -> None:
    """Kill what is left in ``rel``, then remove it and every descendant, deepest first, in
    every hierarchy (a cgroup whose last task is still exiting is retried). Idempotent."""
    kill(rel, timeout)
    deadline = time.monotonic() + timeout
    for h in hierarchies():
        top = h / rel
        if not top.is_dir():
            continue
        dirs = sorted(
            (Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True
        )
        for d in dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
