"""The ``qemu`` runtime: each VM is a QEMU (``qemu-system-x86_64``, Debian ``qemu-system-x86``)
virtual machine booting a kernel configured on the agent - its PVH image when it has one - with
the guest initramfs and the boot's kernel arguments (:mod:`impvm.agent.qemu_guest`,
:class:`~impvm.agent.qemu_guest.GuestBoot`), on the accelerator/machine chosen at agent start by a
real probe boot (:mod:`impvm.agent.qemu_accel`: KVM when it really boots, else TCG; ``microvm``,
else ``q35``).

Disks (a VM never writes to the shared image):

* image disk (serial ``imp-root``): one ext4 file per prepared image (``mkfs.ext4 -d`` from
  :attr:`PreparedImage.rootfs`, mode 0444), kept in the image's cache entry
  (:meth:`ImageStore.derived`) so the cache's size cap counts it and eviction removes it, attached
  ``readonly=on`` to every VM of that image - QEMU refuses writes, whatever the guest does;
* scratch disk (serial ``imp-scratch``): a per-VM sparse ext4 file (no journal) of ``disk_gib``
  GiB in the VM's workdir, the upper layer of the guest's overlayfs root; deleted by
  :meth:`cleanup`. So a file one VM writes is seen by no other VM and no later VM.

Host shares (``extra_ro_binds``, development only): 9p exports with ``readonly=on`` mounted at the
same path in the guest (a host symlink is reproduced as a symlink), like the process runtime's
binds; the development stack uses them to run the host's Python inside the busybox test image.

Privileges: the agent opens every file, socket and device a VM needs - the kernel and
initramfs (handed over as ``/proc/self/fd/N``), the image and scratch disks, console and status
files (``-add-fd`` fd sets), the control socket, the config channel, the tap device and shared
directories - and QEMU starts as a uid and gid of its own (:data:`QEMU_UIDS`, one no other
process has, so one VM's QEMU cannot signal, trace or read another's; through ``setpriv``: no
supplementary group but ``/dev/kvm``'s under KVM, no capability, no new privileges) inside its
seccomp sandbox (:data:`SANDBOX`: obsolete system calls, set*id, fork/exec and resource control
refused). QEMU 7.2 installs the sandbox before ``-runas`` would drop root, so ``-runas`` with
``elevateprivileges=deny`` dies of SIGSYS: QEMU is started unprivileged instead. An agent that
is not root runs QEMU as its own user.

JIT config (the runner image contract): delivered once over the config channel, a
virtio-serial port whose host side is one end of a socket pair only the agent holds
(:mod:`impvm.agent.guest_io`), with the non-secret per-VM config (host name, VM id, network,
shares); the guest init reads it, answers, closes the port, and the agent then closes its end,
so nothing in the running VM can read it again. It is never in a file, never on a command line,
never in a log, and not in fw_cfg (which still answers on its I/O ports: it holds only the
kernel, initramfs and command line); the init hands it to ``/usr/local/bin/runner`` as
``IMP_GITHUB_JITCONFIG`` only.

Console and status: ttyS0 (kernel + init + runner output) → ``<workdir>/console.log`` (0600;
:meth:`inspect` returns its tail with the JIT config replaced by ``***``). ttyS1 →
``<workdir>/status.log``: ``IMPVM-STATUS runner-start`` then ``IMPVM-STATUS exit <code>``, written
by the guest init, read as it grows and kept small (:class:`~impvm.agent.guest_io.StatusLog`):
they give ``running`` and the exit code, both as the guest reported them.
ttyS2 ← the unix socket ``<workdir>/control.sock``: :meth:`stop` writes ``stop`` there, the init
sends SIGTERM to every guest process and powers off when the runner ended.

Network: with a node network (:class:`impvm.agent.network.node.NodeNetwork`, the default of
``impvm agent``) each VM gets its own tap device (``-netdev tap``), NAT to the node's uplink and
its egress policy; the guest's address, gateway and resolvers arrive on the config channel
(``net`` and ``dns`` lines). Without one (``--guest-network unisolated``, development only) QEMU
user-mode networking (slirp): guest 10.0.2.15/24, gateway 10.0.2.2 = the host's loopback, DNS
10.0.2.3 - no isolation at all, the guest reaches every host loopback service.

Lifetime: a VM outlives the agent process, so a job survives an agent crash or upgrade. QEMU runs
in a session of its own (``setsid``: no signal to the agent's process group reaches it) and
nothing ties it to its parent (no parent-death signal; started with ``subprocess.Popen`` and
watched through a pidfd, :meth:`~impvm.agent.survivor.AdoptedProcess.launch`, because an asyncio
subprocess is killed when the agent's event loop closes on a graceful exit); under systemd
(``/run/systemd/system``, root) it is started through
``systemd-run --scope`` in ``impvm-vms.slice``, a cgroup of its own, so stopping or restarting the
agent's unit leaves it alone. Everything a new agent process needs is in the VM's private workdir:
the console and status files, the control socket, and ``qemu.json`` (written at launch: QEMU's
:class:`~impvm.agent.survivor.ProcessIdentity` - pid, boot id, start time, so a reused pid is
never taken for the VM - its image's cache key and its start time). The config channel was
used up at boot and is never needed again. A new agent's :meth:`inspect` of a VM it does not
know re-attaches it (:meth:`_adopt`): a running QEMU is watched through a pidfd and stopped through
its control socket as before; one that ended while no agent ran is reported with the exit code
its guest wrote to the status port (-1 when there is none). ``cleanup`` kills a QEMU still
running (by its identity) and removes everything. Start, wait, tail, stop, cleanup and the network
attach/detach are :class:`~impvm.agent.runtime_base.RuntimeBase`'s; this module supplies the VM.

Modules: :mod:`~impvm.agent.qemu.runtime` (:class:`QemuRuntime`: disks, launch),
:mod:`~impvm.agent.qemu.cmdline` (QEMU's command line), :mod:`~impvm.agent.qemu.files` (what
QEMU is handed), :mod:`~impvm.agent.qemu.sandbox` (uid, seccomp sandbox, session and scope),
:mod:`~impvm.agent.qemu.channels` (config, status and control channels),
:mod:`~impvm.agent.qemu.record` (launch record, re-attach), :mod:`~impvm.agent.qemu.startup`
(:func:`create_qemu_runtime`: guest assets and the accelerator at agent start).
"""

from impvm.agent.qemu.files import QemuFiles
from impvm.agent.qemu.record import kill_all_recorded, kill_recorded, read_record
from impvm.agent.qemu.runtime import QemuRuntime
from impvm.agent.qemu.sandbox import (
    QEMU_UIDS,
    SANDBOX,
    VM_SLICE,
    pick_uid,
    scope_prefix,
    systemd_scope_available,
)
from impvm.agent.qemu.startup import create_qemu_runtime

__all__ = [
    "QEMU_UIDS",
    "SANDBOX",
    "VM_SLICE",
    "QemuFiles",
    "QemuRuntime",
    "create_qemu_runtime",
    "kill_all_recorded",
    "kill_recorded",
    "pick_uid",
    "read_record",
    "scope_prefix",
    "systemd_scope_available",
]
