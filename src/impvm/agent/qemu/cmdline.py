"""QEMU's command line for one VM (:mod:`impvm.agent.qemu`): the machine (``microvm``, ``q35``
when it needs more virtio-mmio transports than ``microvm`` has), the seccomp sandbox, the
kernel's arguments, the serial ports (console, status, control), the disks, the network, the
config channel and the 9p shares, every file and socket one the agent hands over."""

from __future__ import annotations

from collections.abc import Sequence

from impvm.agent.guest_io import CONFIG_PORT
from impvm.agent.qemu.files import QemuFiles
from impvm.agent.qemu.sandbox import SANDBOX
from impvm.agent.qemu_accel import AccelChoice, kernel_args, machine_args
from impvm.agent.runtime import VMRequest

#: virtio-mmio transports of QEMU's microvm machine; more devices need q35.
_MICROVM_TRANSPORTS = 8


def qemu_args(
    qemu: str, accel: AccelChoice, boot_args: Sequence[str], req: VMRequest, files: QemuFiles
) -> list[str]:
    """QEMU's (``qemu``) command line for one VM: machine (of ``accel``), the seccomp sandbox,
    kernel (``boot_args`` beyond console and panic), serial ports, disks, network (the tap
    device of ``files``; user-mode without one), the config channel, shares; every file and
    socket is one ``files`` hands over (QEMU opens nothing itself)."""
    machine = accel.machine
    if machine == "microvm" and len(files.shares) + 4 > _MICROVM_TRANSPORTS:
        machine = "q35"
    sfx = "device" if machine == "microvm" else "pci"
    append = " ".join(
        [
            "console=ttyS0",
            "panic=-1",
            "loglevel=4",
            *kernel_args(accel.accel, machine),
            *boot_args,
        ]
    )
    args = [
        qemu,
        "-name",
        f"impvm:{req.vm_id}",
        *machine_args(accel.accel, machine, req.vcpu, req.memory_mib),
        "-sandbox",
        SANDBOX,
        *files.add_fd,
        "-kernel",
        files.kernel,
        "-initrd",
        files.initrd,
        "-append",
        append,
        # appended, so the agent can compact a long console in place (runtime_base)
        "-chardev",
        f"file,id=console,path={files.console},append=on",
        "-serial",
        "chardev:console",
        # ttyS1/ttyS2 as explicit ISA UARTs: microvm creates only ttyS0 from -serial
        "-chardev",
        f"file,id=status,path={files.status},append=on",
        "-device",
        "isa-serial,chardev=status,index=1",
        "-chardev",
        f"socket,id=ctl,fd={files.control_fd},server=on,wait=off",
        "-device",
        "isa-serial,chardev=ctl,index=2",
        "-drive",
        f"file={files.disk},if=none,id=root,format=raw,readonly=on",
        "-device",
        f"virtio-blk-{sfx},drive=root,serial=imp-root",
        "-drive",
        f"file={files.scratch},if=none,id=scratch,format=raw,discard=unmap",
        "-device",
        f"virtio-blk-{sfx},drive=scratch,serial=imp-scratch",
        "-netdev",
        f"tap,id=net0,fd={files.tap_fd}" if files.tap_fd is not None else "user,id=net0",
        "-device",
        f"virtio-net-{sfx},netdev=net0" + (",romfile=" if sfx == "pci" else ""),
        # the config channel: one end of a socket pair, no path (guest_io)
        "-device",
        f"virtio-serial-{sfx}",
        "-chardev",
        f"socket,id=cfg,fd={files.config_fd}",
        "-device",
        f"virtserialport,chardev=cfg,name={CONFIG_PORT}",
    ]
    for tag, path in files.shares:
        args += [
            "-fsdev",
            f"local,id=fs{tag},path={path},security_model=none,readonly=on,multidevs=remap",
            "-device",
            f"virtio-9p-{sfx},fsdev=fs{tag},mount_tag={tag}",
        ]
    return args
