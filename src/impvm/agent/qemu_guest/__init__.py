"""Guest boot assets of the ``qemu`` runtime: the kernel and the guest initramfs.

Kernel: a Debian kernel image (``/boot/vmlinuz-<version>``, package ``linux-image-amd64``) with its
modules in ``/lib/modules/<version>``. The agent is configured with one (``--qemu-kernel``); by
default :func:`find_kernel` takes the newest ``/boot/vmlinuz-*`` whose modules include 9p (needed
for read-only host shares; Debian's ``linux-image-cloud-amd64`` lacks ``CONFIG_NET_9P`` and works
only without shares).

Boot image: the kernel's own ELF ``vmlinux`` taken out of the bzImage (:func:`pvh_image`), so
QEMU starts it at its PVH entry point (the Xen ``PHYS32_ENTRY`` ELF note Debian's kernels carry,
``CONFIG_PVH``; QEMU's x86 loader takes such an ELF for ``-kernel``) and the guest skips the
bzImage's real-mode setup and decompressor: under TCG, unpacking 53-66 MB of kernel took about
0.5 s of every boot. A kernel without the note boots from its bzImage. PVH entry bypasses the
decompressor's KASLR, so the guest kernel runs at its link address: that only spares the job
itself work in attacking its own guest kernel, and root in a single-use VM gives it nothing the
VM boundary does not already confine.

Kernel command line (:data:`FAST_BOOT_ARGS`): no crypto self-tests, no IO-APIC timer check, lock
prefixes left in place.

Initramfs (uncompressed ``newc`` cpio, written by :func:`build_initramfs`, cached by content):

* ``/bin/busybox`` (Debian ``busybox-static``) with a symlink for each applet the init runs
  (:data:`GUEST_APPLETS`; every applet on request: the kernel unpacks each entry at every boot);
* ``/init``: the guest init (``impvm/agent/assets/guest/init``, see its header);
* ``/lib/modules/<path>.ko`` for :data:`GUEST_MODULES` and their dependencies (from the kernel's
  ``modules.dep``; built-in ones from ``modules.builtin`` are skipped) without their appended
  signatures when the kernel does not require them (``CONFIG_MODULE_SIG_FORCE`` unset in its
  ``/boot/config-<version>``): the guest would check, for every module at every boot, an RSA
  signature of a file the agent itself put there - under TCG a good part of loading a module -
  and loads an unsigned one all the same (taint flag ``E``); ``/etc/imp/modules``, the
  load order (dependencies first), and ``/etc/imp/modules-pci``, the ones only a machine with a
  PCI bus needs (q35; microvm has none, its init skips them).

It holds nothing per VM and nothing secret; per-VM data arrives through the config channel at
launch (:mod:`impvm.agent.guest_io`), never through fw_cfg.

Modules: :mod:`~impvm.agent.qemu_guest.boot` (applets, kernel arguments, :class:`GuestBoot`),
:mod:`~impvm.agent.qemu_guest.kernel` (the kernel and its modules),
:mod:`~impvm.agent.qemu_guest.pvh` (the PVH boot image),
:mod:`~impvm.agent.qemu_guest.initramfs` (the initramfs).
"""

from impvm.agent.qemu_guest.boot import FAST_BOOT_ARGS, GUEST_APPLETS, GuestAssetError, GuestBoot
from impvm.agent.qemu_guest.initramfs import (
    build_initramfs,
    init_script,
    module_signatures_required,
    unsigned_module,
)
from impvm.agent.qemu_guest.kernel import (
    GUEST_MODULES,
    Kernel,
    find_kernel,
    module_order,
    pci_only_modules,
)
from impvm.agent.qemu_guest.pvh import extract_vmlinux, pvh_image

__all__ = [
    "FAST_BOOT_ARGS",
    "GUEST_APPLETS",
    "GUEST_MODULES",
    "GuestAssetError",
    "GuestBoot",
    "Kernel",
    "build_initramfs",
    "extract_vmlinux",
    "find_kernel",
    "init_script",
    "module_order",
    "module_signatures_required",
    "pci_only_modules",
    "pvh_image",
    "unsigned_module",
]
