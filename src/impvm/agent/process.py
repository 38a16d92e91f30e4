"""The ``process`` runtime: each VM is the image's ``/usr/local/bin/runner`` run in a bubblewrap
(``bwrap``, Debian package ``bubblewrap``) sandbox instead of a microVM.

Sandbox (per VM):

* own namespaces: ``--unshare-all --share-net`` (user/ipc/pid/uts/cgroup are private; the network
  is shared so the runner reaches the GitHub stand-in on host loopback), ``--die-with-parent``
  (VMs die with the agent), ``--new-session`` (no TIOCSTI into the agent's terminal);
* ``/``: the prepared image rootfs, read-only. bwrap cannot create mount points on a read-only
  bind, so ``/`` is bwrap's tmpfs with every top-level entry of the rootfs bound read-only (and
  directories that contain a mount point split the same way), then ``--remount-ro /``;
* private writable scratch: ``<workdir>/scratch/work`` at ``/home/runner/_work`` and
  ``<workdir>/scratch/tmp`` at ``/tmp``; fresh ``/proc`` and ``/dev``;
* optional read-only host binds (``extra_ro_binds``, same path inside; a host symlink is
  reproduced as a symlink) - the development stack uses :func:`host_python_binds` to expose the
  host's Python to a stand-in runner layer;
* environment: exactly a minimal set (``PATH``, ``HOME``, ``LANG``, ``IMP_VM_ID`` plus
  ``extra_env``) and ``IMP_GITHUB_JITCONFIG``. The JIT config is passed in the *environment* of
  the bwrap process (bwrap hands its environment to the sandboxed command), never on a command
  line (``--setenv`` would show it in ``/proc/<pid>/cmdline``) and never in a file;
* console: stdout+stderr to ``<workdir>/console.log`` (mode 0600). :meth:`ProcessRuntime.inspect`
  returns its tail with the JIT config replaced by ``***`` (defence in depth: the wrapper never
  prints it, but a guest program might).

Resource limits: ``vcpu``, ``memory_mib`` and ``disk_gib`` are advisory for this runtime and not
enforced (no cgroup is created: cgroup v2 delegation is not generally available to the agent; the
development host may only offer cgroup v1). Use the ``qemu`` runtime where limits matter.

Limitation: the rootfs is read-only, so a program that writes into its own install directory (the
real GitHub runner writes ``.runner``/``_diag`` under ``/home/runner/actions-runner``) needs the
``qemu`` runtime or a writable bind; the stand-in runner only writes to ``_work`` and ``/tmp``.

State lives in memory (the agent is bwrap's parent and ``--die-with-parent`` ends VMs with it), so
after an agent restart :meth:`ProcessRuntime.inspect` reports ``missing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from impvm.agent.images import ImageStore, PreparedImage, _remove_tree
from impvm.agent.runtime import (
    ImageError,
    RuntimeError_,
    Secret,
    VMRequest,
    VMState,
    VMStatus,
)

RUNNER = "/usr/local/bin/runner"
WORK_DIR = PurePosixPath("/home/runner/_work")
TMP_DIR = PurePosixPath("/tmp")  # noqa: S108 - a path inside the sandbox
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_LOG = "console.log"
_TAIL_BYTES = 16384


def host_python_binds(python: str | None = None) -> list[Path]:
    """Host paths to bind read-only so ``python`` (default: ``sys.executable``) and the ``impvm``
    package it imports run inside a sandbox whose image has no Python (e.g. the busybox test base).

    Returns existing paths: the interpreter's prefixes, the importable ``sys.path`` directories,
    and the dynamic loader / C library directories (``/lib64``, ``/lib``, ``/usr/lib64``,
    ``/usr/lib/<multiarch>``; symlinks such as merged-usr ``/lib -> usr/lib`` are reproduced).
    """
    exe = Path(python or sys.executable)
    dirs = [Path(sys.prefix), Path(sys.base_prefix), exe.resolve().parent.parent]
    dirs += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    libs = [Path("/lib64"), Path("/lib"), Path("/usr/lib64"), Path(f"/usr/lib/{multiarch}")]
    links: list[Path] = [p for p in libs if p.is_symlink()]
    dirs += [p for p in libs if not p.is_symlink()]
    real = {Path(os.path.realpath(p)) for p in dirs if p.exists()}
    out: list[Path] = []
    for c in sorted(real, key=lambda p: (len(p.parts), str(p))):
        if not any(c.is_relative_to(o) for o in out):
            out.append(c)
    return out + links


def _remove_workdir(workdir: Path) -> None:
    """Remove a VM's workdir completely (blocking; run in a thread)."""
    if os.path.lexists(workdir):
        _remove_tree(workdir)
    if os.path.lexists(workdir):
        shutil.rmtree(workdir)


def _ancestors(p: PurePosixPath) -> list[PurePosixPath]:
    return [a for a in p.parents if str(a) != "/"]


def _root_args(
    rootfs: Path, mounts: set[PurePosixPath], symlinks: Mapping[PurePosixPath, str]
) -> list[str]:
    """bwrap args that rebuild the image tree read-only on bwrap's tmpfs root.

    ``mounts``: destinations that something else mounts (they are skipped here, their ancestors
    are created as directories and their siblings bound one by one). ``symlinks``: host symlinks
    to reproduce where the image has nothing at that path.
    """
    split = {a for m in [*mounts, *symlinks] for a in _ancestors(m)}
    args: list[str] = []

    def walk(rel: PurePosixPath) -> None:
        host = rootfs / str(rel).lstrip("/")
        names: list[str] = []
        if host.is_dir() and not host.is_symlink():
            names = sorted(os.listdir(host))
        for name in names:
            dest = rel / name
            src = host / name
            if dest in mounts:
                continue
            if dest in split and src.is_dir() and not src.is_symlink():
                args.extend(["--dir", str(dest)])
                walk(dest)
            elif src.is_symlink():
                args.extend(["--symlink", os.readlink(src), str(dest)])
            else:
                args.extend(["--ro-bind", str(src), str(dest)])
        for s in sorted(split):
            if s.parent == rel and s.name not in names:
                args.extend(["--dir", str(s)])
                walk(s)
        for link, target in sorted(symlinks.items()):
            if link.parent == rel and link.name not in names:
                args.extend(["--symlink", target, str(link)])

    walk(PurePosixPath("/"))
    return args


@dataclass
class _VM:
    proc: asyncio.subprocess.Process
    prepared: PreparedImage
    secret: str
    started_at: datetime
    log: Path
    child_pid: int | None = None
    pid_ns: int | None = None
    json_exit: int | None = None
    killed: bool = False
    finished_at: datetime | None = None
    exit_code: int | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class ProcessRuntime:
    """:class:`impvm.agent.runtime.Runtime` running each VM in a bubblewrap sandbox (see module
    docstring).

    ``store``: the image cache; ``extra_ro_binds``: host paths bound read-only at the same path;
    ``extra_env``: additional non-secret environment for the runner; ``auth_file``: registry auth
    (docker-config style) for pulls; ``bwrap``: the bubblewrap executable; ``tail_lines``: lines
    returned in :attr:`VMState.log_tail`.
    """

    name = "process"

    def __init__(
        self,
        store: ImageStore,
        *,
        extra_ro_binds: Sequence[Path] = (),
        extra_env: Mapping[str, str] | None = None,
        auth_file: Path | None = None,
        bwrap: str = "bwrap",
        tail_lines: int = 40,
    ) -> None:
        self.store = store
        self.extra_ro_binds = [Path(p) for p in extra_ro_binds]
        self.extra_env = dict(extra_env or {})
        if "IMP_GITHUB_JITCONFIG" in self.extra_env:
            raise ValueError("IMP_GITHUB_JITCONFIG is set per VM by start(), not in extra_env")
        self.auth_file = auth_file
        self.bwrap = bwrap
        self.tail_lines = tail_lines
        self._prepared: dict[str, PreparedImage] = {}
        self._vms: dict[str, _VM] = {}

    async def prepare(self, req: VMRequest) -> None:
        """Pull/verify/unpack ``req.image`` + ``req.runner_layer`` through the store (cached).
        Raises :class:`ImageError`."""
        self._prepared[req.vm_id] = await self.store.prepare(
            req.image,
            req.runner_layer,
            allow_unpinned=req.allow_unpinned_images,
            auth_file=self.auth_file,
            public_key=req.verify_public_key,
        )

    def _bwrap_args(self, req: VMRequest, prepared: PreparedImage, status_fd: int) -> list[str]:
        scratch = req.workdir / "scratch"
        binds: list[str] = []
        mounts = {PurePosixPath("/proc"), PurePosixPath("/dev"), TMP_DIR, WORK_DIR}
        symlinks: dict[PurePosixPath, str] = {}
        for p in self.extra_ro_binds:
            dest = PurePosixPath(str(p))
            if p.is_symlink():
                symlinks[dest] = os.readlink(p)
            elif p.exists():
                mounts.add(dest)
                binds += ["--ro-bind", str(p), str(dest)]
        hostname = re.sub(r"[^a-z0-9-]", "-", req.name.lower())[:63].strip("-") or "impvm"
        return [
            self.bwrap,
            "--unshare-all",
            "--share-net",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            hostname,
            *_root_args(prepared.rootfs, mounts, symlinks),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--bind",
            str(scratch / "tmp"),
            str(TMP_DIR),
            "--bind",
            str(scratch / "work"),
            str(WORK_DIR),
            *binds,
            "--remount-ro",
            "/",
            "--chdir",
            str(WORK_DIR),
            "--json-status-fd",
            str(status_fd),
            "--",
            RUNNER,
        ]

    async def start(self, req: VMRequest, jitconfig: Secret) -> None:
        """Launch the sandbox running ``/usr/local/bin/runner`` with ``IMP_GITHUB_JITCONFIG`` in
        its environment only. Prepares the image first when :meth:`prepare` was not called.
        Raises :class:`RuntimeError_` when the VM already runs or bwrap cannot be started (the
        message never contains the JIT config)."""
        if req.vm_id in self._vms and self._vms[req.vm_id].exit_code is None:
            raise RuntimeError_(f"VM {req.vm_id} is already running")
        prepared = self._prepared.get(req.vm_id)
        if prepared is None or not prepared.rootfs.is_dir():
            await self.prepare(req)
            prepared = self._prepared[req.vm_id]
        req.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(req.workdir, 0o700)
        for d in ("scratch/tmp", "scratch/work"):
            (req.workdir / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        # /tmp semantics inside the sandbox; the parent workdir is 0700.
        os.chmod(req.workdir / "scratch/tmp", 0o1777)  # noqa: S103
        log = req.workdir / _LOG
        env = {
            "PATH": _PATH,
            "HOME": "/home/runner",
            "LANG": "C.UTF-8",
            "IMP_VM_ID": req.vm_id,
            **self.extra_env,
            "IMP_GITHUB_JITCONFIG": jitconfig.reveal(),
        }
        rfd, wfd = os.pipe()
        logfd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.store.retain(prepared.key)
        try:
            args = self._bwrap_args(req, prepared, wfd)
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logfd,
                stderr=logfd,
                env=env,
                pass_fds=(wfd,),
            )
        except OSError as exc:
            self.store.release(prepared.key)
            os.close(rfd)
            raise RuntimeError_(f"starting bwrap for VM {req.vm_id} failed: {exc}") from None
        finally:
            os.close(wfd)
            os.close(logfd)
        vm = _VM(
            proc=proc,
            prepared=prepared,
            secret=jitconfig.reveal(),
            started_at=datetime.now(UTC),
            log=log,
        )
        self._vms[req.vm_id] = vm
        vm.tasks.append(asyncio.create_task(self._read_status(vm, rfd)))
        vm.tasks.append(asyncio.create_task(self._wait(vm)))

    async def _read_status(self, vm: _VM, rfd: int) -> None:
        """Read bwrap's ``--json-status-fd`` stream: child pid/pid namespace, then exit code."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(rfd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        try:
            # One JSON object per line: {"child-pid": N, "pid-namespace": N, ...} once the
            # sandbox is set up, {"exit-code": N} when the command ended.
            while line := await reader.readline():
                with contextlib.suppress(ValueError):
                    self._apply_status(vm, json.loads(line))
        except OSError:
            pass
        finally:
            transport.close()

    def _apply_status(self, vm: _VM, obj: object) -> None:
        if not isinstance(obj, dict):
            return
        if "child-pid" in obj:
            vm.child_pid = int(obj["child-pid"])
            vm.pid_ns = int(obj.get("pid-namespace", 0)) or None
        if "exit-code" in obj:
            vm.json_exit = int(obj["exit-code"])

    async def _wait(self, vm: _VM) -> None:
        rc = await vm.proc.wait()
        # Let the status reader see the final line (the pipe closes when bwrap exits).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(vm.tasks[0]), 2.0)
        if vm.killed or rc < 0:
            vm.exit_code = -1
        elif vm.json_exit is not None:
            vm.exit_code = vm.json_exit
        else:
            vm.exit_code = rc
        vm.finished_at = datetime.now(UTC)

    def _scrub(self, text: str, secret: str) -> str:
        return text.replace(secret, "***") if secret else text

    def _tail(self, vm: _VM) -> str:
        try:
            with vm.log.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - _TAIL_BYTES))
                data = f.read()
        except OSError:
            return ""
        lines = data.decode(errors="replace").splitlines()[-self.tail_lines :]
        return self._scrub("\n".join(lines), vm.secret)

    async def inspect(self, req: VMRequest) -> VMState:
        """Status ``starting`` (bwrap launched, sandbox not yet set up), ``running``, ``exited``
        (``exit_code``: the runner's exit status; -1 when killed) or ``missing`` (unknown to this
        runtime instance). ``log_tail``: last ``tail_lines`` console lines, JIT config scrubbed."""
        vm = self._vms.get(req.vm_id)
        if vm is None:
            return VMState(status="missing")
        exited = vm.exit_code is not None  # before reading: an exited VM's log is complete
        tail = await asyncio.to_thread(self._tail, vm)
        if exited:
            return VMState(
                status="exited",
                exit_code=vm.exit_code,
                started_at=vm.started_at,
                finished_at=vm.finished_at,
                log_tail=tail,
            )
        status: VMStatus = "running" if vm.child_pid is not None else "starting"
        return VMState(status=status, started_at=vm.started_at, log_tail=tail)

    def _namespace_pids(self, vm: _VM) -> list[int]:
        """Host pids of the processes in the VM's pid namespace, except its init (bwrap)."""
        if vm.pid_ns is None:
            return []
        want = f"pid:[{vm.pid_ns}]"
        pids: list[int] = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == vm.child_pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/pid") == want:
                    pids.append(int(entry))
        return pids

    async def stop(self, req: VMRequest, grace_seconds: float = 10.0) -> None:
        """SIGTERM every process of the sandbox (not its init), then after ``grace_seconds``
        SIGKILL bwrap (``--die-with-parent`` tears the namespace down). Idempotent."""
        vm = self._vms.get(req.vm_id)
        if vm is None or vm.proc.returncode is not None:
            if vm is not None:
                await asyncio.gather(*vm.tasks, return_exceptions=True)
            return
        if grace_seconds > 0:
            pids = await asyncio.to_thread(self._namespace_pids, vm)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            if not pids:
                with contextlib.suppress(ProcessLookupError):
                    vm.proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(vm.proc.wait()), grace_seconds)
        if vm.proc.returncode is None:
            vm.killed = True
            with contextlib.suppress(ProcessLookupError):
                vm.proc.kill()
            if vm.child_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(vm.child_pid, signal.SIGKILL)
        await asyncio.gather(*vm.tasks, return_exceptions=True)

    async def cleanup(self, req: VMRequest) -> None:
        """Stop the VM if needed (no grace), release its image, remove ``req.workdir`` (scratch,
        console log) and forget the VM and its JIT config. Idempotent."""
        await self.stop(req, grace_seconds=0)
        vm = self._vms.pop(req.vm_id, None)
        if vm is not None:
            self.store.release(vm.prepared.key)
        self._prepared.pop(req.vm_id, None)
        await asyncio.to_thread(_remove_workdir, req.workdir)


__all__ = ["ImageError", "ProcessRuntime", "host_python_binds"]
