"""The ``process`` runtime: each VM is the image's ``/usr/local/bin/runner`` run in a bubblewrap
(``bwrap``, Debian package ``bubblewrap``) sandbox instead of a microVM.

Sandbox (per VM):

* own namespaces: ``--unshare-all --share-net`` (user/ipc/pid/uts/cgroup are private),
  ``--die-with-parent`` (VMs die with the agent), ``--new-session`` (no TIOCSTI into the agent's
  terminal);
* network: with a node network (:class:`impvm.agent.network.node.NodeNetwork`) bwrap starts
  inside the VM's own network namespace (``nsenter --net``: a veth pair to the node, NAT, the
  same egress policy as a QEMU guest; ``/etc/resolv.conf`` names the node's resolvers). The
  sandbox cannot reconfigure that namespace: it belongs to the agent's user namespace, not the
  sandbox's. Without one (``--guest-network unisolated``, development only) the sandbox shares the
  agent's network and reaches everything the host reaches, loopback included;
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
* console: stdout+stderr to ``<workdir>/console.log`` (mode 0600); ``inspect`` returns its tail
  with the JIT config replaced by ``***``.

Resource limits: ``vcpu``, ``memory_mib`` and ``disk_gib`` are advisory for this runtime and not
enforced (no cgroup is created: cgroup v2 delegation is not generally available to the agent; the
development host may only offer cgroup v1). Use the ``qemu`` runtime where limits matter.

Limitation: the rootfs is read-only, so a program that writes into its own install directory (the
real GitHub runner writes ``.runner``/``_diag`` under ``/home/runner/actions-runner``) needs the
``qemu`` runtime or a writable bind; the stand-in runner only writes to ``_work`` and ``/tmp``.

State lives in memory (the agent is bwrap's parent and ``--die-with-parent`` ends VMs with it), so
after an agent restart ``inspect`` reports ``missing`` and the VM is Lost: this runtime does not
re-attach. It could not without reshaping the sandbox: bwrap's status stream and the runner's
console are pipes the agent owns, and the sandbox's pid namespace ends with bwrap, so a sandbox
kept alive would run on with nobody reading its output; the ``qemu`` runtime re-attaches.
Start, wait, tail, stop, cleanup and the network attach/detach are
:class:`~impvm.agent.runtime_base.RuntimeBase`'s; this module supplies the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from impvm.agent.images import ImageStore, PreparedImage
from impvm.agent.network.node import GuestNetwork, NodeNetwork
from impvm.agent.runtime import ImageError, Secret, VMRequest, VMRuntimeError
from impvm.agent.runtime_base import CONSOLE_LOG, LaunchedVM, RuntimeBase, guest_hostname

log = logging.getLogger("impvm.agent.process")

RUNNER = "/usr/local/bin/runner"
WORK_DIR = PurePosixPath("/home/runner/_work")
TMP_DIR = PurePosixPath("/tmp")  # noqa: S108 - a path inside the sandbox
RESOLV_CONF = PurePosixPath("/etc/resolv.conf")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def host_python_binds(python: str | None = None) -> list[Path]:
    """Host paths to bind read-only so ``python`` (default: ``sys.executable``) and the ``impvm``
    package it imports run inside a sandbox whose image has no Python (e.g. the busybox test base).

    Returns existing paths, and only what that needs: the interpreter's installation
    (``sys.base_prefix``, the real executable's prefix), its environment (``sys.prefix``: a
    virtual environment with the installed packages), the ``impvm`` package's own directory when
    it lives elsewhere (an editable install), and the dynamic loader / C library directories
    (``/lib64``, ``/lib``, ``/usr/lib64``, ``/usr/lib/<multiarch>``; symlinks such as merged-usr
    ``/lib -> usr/lib`` are reproduced). Never the working directory, a script's own directory
    or any other ``sys.path`` entry: whatever sits there (an App key beside the script that
    started the stack) would be shared with every guest.
    """
    import impvm

    exe = Path(python or sys.executable)
    dirs = [Path(sys.prefix), Path(sys.base_prefix), exe.resolve().parent.parent]
    package = Path(impvm.__file__).resolve().parent
    if not any(package.is_relative_to(os.path.realpath(d)) for d in dirs):
        dirs.append(package)
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


def _ancestors(p: PurePosixPath) -> list[PurePosixPath]:
    return [a for a in p.parents if str(a) != "/"]


def _root_args(
    rootfs: Path, mounts: set[PurePosixPath], symlinks: Mapping[PurePosixPath, str]
) -> list[str]:
    """bwrap args that rebuild the image tree read-only on bwrap's tmpfs root.

    ``mounts``: destinations that something else mounts (they are skipped here, their ancestors
    are created as directories and their siblings bound one by one). ``symlinks``: host symlinks
    to reproduce where the image has nothing at that path.

    bwrap creates a mount point by walking its path in the new root, following symlinks, before
    the host's root is detached (it is ``/oldroot`` then): an image symlink on the way (``home ->
    /oldroot/etc``) would have it create directories and files on the host. So an ancestor of a
    mount point is always a directory of bwrap's own tmpfs, whatever the image has there (its
    symlink or file is not reproduced), and bwrap never resolves a mount point through the image.
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
            if dest in split:
                args.extend(["--dir", str(dest)])
                walk(dest)  # only a real directory of the image has entries to bind
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
class _SandboxVM(LaunchedVM):
    """A bwrap sandbox; ``child_pid``/``pid_ns`` and ``json_exit`` come from bwrap's
    ``--json-status-fd`` (read by ``status_task``)."""

    child_pid: int | None = None
    pid_ns: int | None = None
    json_exit: int | None = None
    status_task: asyncio.Task[None] | None = None


class ProcessRuntime(RuntimeBase[_SandboxVM]):
    """:class:`impvm.agent.runtime.Runtime` running each VM in a bubblewrap sandbox (see module
    docstring).

    ``store``: the image cache; ``extra_ro_binds``: host paths bound read-only at the same path;
    ``extra_env``: additional non-secret environment for the runner; ``auth_file``: registry auth
    (docker-config style) for pulls; ``bwrap``: the bubblewrap executable; ``tail_lines``: lines
    returned in :attr:`RuntimeState.log_tail`; ``network``: the node's guest networks (``None``:
    the sandbox shares the agent's network).
    """

    name = "process"
    network_kind = "netns"

    def __init__(
        self,
        store: ImageStore,
        *,
        extra_ro_binds: Sequence[Path] = (),
        extra_env: Mapping[str, str] | None = None,
        auth_file: Path | None = None,
        bwrap: str = "bwrap",
        tail_lines: int = 40,
        network: NodeNetwork | None = None,
    ) -> None:
        super().__init__(store, auth_file=auth_file, tail_lines=tail_lines, network=network)
        self.extra_ro_binds = [Path(p) for p in extra_ro_binds]
        self.extra_env = dict(extra_env or {})
        if "IMP_GITHUB_JITCONFIG" in self.extra_env:
            raise ValueError("IMP_GITHUB_JITCONFIG is set per VM by start(), not in extra_env")
        self.bwrap = bwrap

    def _bwrap_args(
        self,
        req: VMRequest,
        prepared: PreparedImage,
        status_fd: int,
        net: GuestNetwork | None = None,
    ) -> list[str]:
        """bwrap's command line for one VM (see the module docstring); ``status_fd`` gets
        bwrap's JSON status stream; with ``net`` bwrap runs in the VM's network namespace."""
        scratch = req.workdir / "scratch"
        binds: list[str] = []
        mounts = {PurePosixPath("/proc"), PurePosixPath("/dev"), TMP_DIR, WORK_DIR}
        enter: list[str] = []
        if net is not None and net.netns is not None:
            enter = ["nsenter", f"--net={net.netns}", "--"]
            mounts.add(RESOLV_CONF)
            binds += ["--ro-bind", str(req.workdir / "resolv.conf"), str(RESOLV_CONF)]
        symlinks: dict[PurePosixPath, str] = {}
        for p in self.extra_ro_binds:
            dest = PurePosixPath(str(p))
            if p.is_symlink():
                symlinks[dest] = os.readlink(p)
            elif p.exists():
                mounts.add(dest)
                binds += ["--ro-bind", str(p), str(dest)]
        return [
            *enter,
            self.bwrap,
            "--unshare-all",
            "--share-net",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            guest_hostname(req),
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

    async def _launch(
        self, req: VMRequest, prepared: PreparedImage, jitconfig: Secret, net: GuestNetwork | None
    ) -> _SandboxVM:
        """Launch the sandbox running ``/usr/local/bin/runner`` with ``IMP_GITHUB_JITCONFIG`` in
        its environment only, in ``net``'s namespace (its resolvers in ``/etc/resolv.conf``).
        Raises :class:`VMRuntimeError` when bwrap cannot be started."""
        req.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(req.workdir, 0o700)
        for d in ("scratch/tmp", "scratch/work"):
            (req.workdir / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        # /tmp semantics inside the sandbox; the parent workdir is 0700.
        os.chmod(req.workdir / "scratch/tmp", 0o1777)  # noqa: S103
        if net is not None:
            resolv = "".join(f"nameserver {d}\n" for d in net.dns)
            await asyncio.to_thread((req.workdir / "resolv.conf").write_text, resolv)
        env = {
            "PATH": _PATH,
            "HOME": "/home/runner",
            "LANG": "C.UTF-8",
            "IMP_VM_ID": req.vm_id,
            **self.extra_env,
            "IMP_GITHUB_JITCONFIG": jitconfig.reveal(),
        }
        rfd, wfd = os.pipe()
        logfd = os.open(
            req.workdir / CONSOLE_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._bwrap_args(req, prepared, wfd, net),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logfd,
                stderr=logfd,
                env=env,
                pass_fds=(wfd,),
            )
        except OSError as exc:
            os.close(rfd)
            raise VMRuntimeError(f"starting bwrap for VM {req.vm_id} failed: {exc}") from None
        finally:
            os.close(wfd)
            os.close(logfd)
        vm = _SandboxVM(
            proc=proc, prepared=prepared, secret=jitconfig.reveal(), workdir=req.workdir
        )
        vm.status_task = asyncio.create_task(self._read_status(vm, rfd))
        vm.tasks.append(vm.status_task)
        return vm

    async def _read_status(self, vm: _SandboxVM, rfd: int) -> None:
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

    def _apply_status(self, vm: _SandboxVM, obj: object) -> None:
        """Take one ``--json-status-fd`` object: the child pid and pid namespace, or the exit
        code."""
        if not isinstance(obj, dict):
            return
        if "child-pid" in obj:
            vm.child_pid = int(obj["child-pid"])
            vm.pid_ns = int(obj.get("pid-namespace", 0)) or None
        if "exit-code" in obj:
            vm.json_exit = int(obj["exit-code"])

    async def _exit_code(self, vm: _SandboxVM, returncode: int) -> int:
        """bwrap's report of the runner's exit (-1 when killed); bwrap's own status without it."""
        if vm.status_task is not None:
            # Let the status reader see the final line (the pipe closes when bwrap exits).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(vm.status_task), 2.0)
        if vm.killed or returncode < 0:
            return -1
        return vm.json_exit if vm.json_exit is not None else returncode

    async def _runner_started(self, vm: _SandboxVM) -> bool:
        """The sandbox is set up (bwrap reported its child) and runs the runner."""
        return vm.child_pid is not None

    def _namespace_pids(self, vm: _SandboxVM) -> list[int]:
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

    async def _ask_to_stop(self, vm: _SandboxVM) -> None:
        """SIGTERM every process of the sandbox (not its init); bwrap itself when none is
        known yet."""
        pids = await asyncio.to_thread(self._namespace_pids, vm)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not pids:
            with contextlib.suppress(ProcessLookupError):
                vm.proc.terminate()

    def _kill(self, vm: _SandboxVM) -> None:
        """SIGKILL bwrap and the sandbox's init (``--die-with-parent`` tears the namespace
        down)."""
        super()._kill(vm)
        if vm.child_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.child_pid, signal.SIGKILL)

    async def stop(self, req: VMRequest, grace_seconds: float = 10.0) -> None:
        """:meth:`RuntimeBase.stop`, then wait (at most 10 s) until no process of the sandbox
        is left: the kernel kills what is left of a pid namespace once its init died, but not
        at once, and until then they hold the JIT config in their environment."""
        await super().stop(req, grace_seconds)
        vm = self._vms.get(req.vm_id)
        if vm is None:
            return
        for _ in range(200):
            if not await asyncio.to_thread(self._namespace_pids, vm):
                return
            await asyncio.sleep(0.05)
        log.warning("vm %s: processes of its sandbox outlived it", req.vm_id)


__all__ = ["ImageError", "ProcessRuntime", "host_python_binds"]
