"""What a test cluster made, recorded before it is made, so whoever comes next can remove it:
the stop of the same cluster, the next start of a cluster of that name, or any start that finds
a cluster whose owner process is gone (a crashed test run).

A record is ``<workdir>/cluster.json``: name, token, owner (pid and its start time, so a reused
pid is not taken for the owner; none for a cluster the script started, which lives until
``scripts/cluster.sh down`` or the next ``up``), the cgroup subtree, namespaces and host links.
Removal kills every process in the cgroup subtree (control plane, containerd, shims, containers,
kubelet, kube-proxy, QEMU), unmounts everything under the workdir (kubelet's volumes,
containerd's snapshots, shm and pod network namespaces), deletes namespaces and links, removes
the cgroups and the workdir.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from impvm.devstack.cluster import cgroups, network

#: where clusters live unless told otherwise (``IMPVM_CLUSTER_DIR``)
DEFAULT_BASE = Path(os.environ.get("IMPVM_CLUSTER_DIR", "/var/tmp/impvm-clusters"))  # noqa: S108
RECORD = "cluster.json"


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or
    None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass
class ClusterRecord:
    """See the module docstring."""

    name: str
    token: str
    workdir: str
    owner_pid: int | None = None
    owner_start: int | None = None
    cgroup: str = ""
    #: a short directory for the nodes' sockets (a unix socket path has at most 107 bytes)
    rundir: str = ""
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return Path(self.workdir) / RECORD

    def save(self) -> None:
        """Write the record (atomically: a crash leaves the old one or the new one)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(self.path)

    @classmethod
    def load(cls, path: Path) -> ClusterRecord | None:
        """The record at ``path``; None when missing or unreadable."""
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def owner_alive(self) -> bool:
        """Whether the owner process still runs (a detached cluster counts as alive)."""
        if self.owner_pid is None:
            return True
        return process_start(self.owner_pid) == self.owner_start


def mounts_under(root: Path) -> list[str]:
    """Mount points at or under ``root``, deepest first (``/proc/self/mountinfo``; octal escapes
    such as ``\\040`` decoded)."""
    prefix = str(root.resolve())
    points: list[str] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def unmount_all(root: Path) -> None:
    """Unmount everything under ``root`` (lazily: a mount still busy is detached now and freed
    when its last user goes). Raises ``RuntimeError`` when one stays."""
    for _ in range(5):
        points = mounts_under(root)
        if not points:
            return
        for p in points:
            subprocess.run(["umount", "-l", p], capture_output=True, timeout=30)
    if left := mounts_under(root):
        raise RuntimeError(f"mounts left under {root}: {left[:5]}")


def remove(record: ClusterRecord, keep: tuple[str, ...] = ()) -> None:
    """Remove everything the record names (see the module docstring); ``keep``: names of
    entries of the workdir to leave (caches). Idempotent."""
    if record.cgroup:
        cgroups.kill(record.cgroup)
    workdir = Path(record.workdir)
    if workdir.exists():
        unmount_all(workdir)
    network.delete(record.netns, record.links)
    if record.cgroup:
        cgroups.remove(record.cgroup)
    if record.rundir:
        shutil.rmtree(record.rundir, ignore_errors=True)
    if workdir.exists():
        for entry in workdir.iterdir():
            if entry.name in keep or entry.name == RECORD:
                continue
            if entry.is_dir() and not entry.is_symlink():
                # rm(1): the nodes' image snapshots are many small files, which it removes
                # several times faster than shutil.rmtree
                subprocess.run(["rm", "-rf", "--one-file-system", "--", str(entry)], timeout=600)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
        with contextlib.suppress(OSError):
            record.path.unlink()
        with contextlib.suppress(OSError):
            workdir.rmdir()


def remove_stale(base: Path = DEFAULT_BASE, name: str | None = None) -> list[str]:
    """Remove the clusters under ``base`` whose owner is gone, and the one named ``name``
    (whatever its owner: it is about to be started again). Returns the names removed."""
    removed: list[str] = []
    if not base.is_dir():
        return removed
    for path in sorted(base.glob(f"*/{RECORD}")):
        record = ClusterRecord.load(path)
        if record is None:
            continue
        if record.name == name and record.owner_alive():
            stop_owner(record)
        if record.name == name or not record.owner_alive():
            remove(record, keep=CACHES)
            removed.append(record.name)
    return removed


def stop_owner(record: ClusterRecord, timeout: float = 60.0) -> None:
    """Ask the process that owns a cluster to stop it (SIGTERM), and SIGKILL it when it has not
    exited within ``timeout`` seconds: a live owner would otherwise tear down, at its own exit,
    whatever was started in its place. Not for the calling process itself."""
    pid = record.owner_pid
    if pid is None or pid == os.getpid() or not record.owner_alive():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while record.owner_alive():
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.2)


#: entries of a cluster's workdir kept across runs (none: a push to a fresh registry takes
#: seconds, and a test session's cluster has a name of its own each time)
CACHES: tuple[str, ...] = ()
