"""How the guest boots (:mod:`impvm.agent.qemu_guest`): the busybox applets its init runs, the
kernel arguments that shorten the boot, the agent's boot configuration (:class:`GuestBoot`), and
the error of a missing boot asset."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The busybox applets the guest init runs (the initramfs links only these).
GUEST_APPLETS = (
    "chmod",
    "chroot",
    "env",
    "grep",
    "insmod",
    "ip",
    "kill",
    "ln",
    "mkdir",
    "mount",
    "poweroff",
    "reboot",
    "rmmod",
    "sed",
    "sh",
    "sleep",
    "stty",
    "sync",
    "umount",
    "uname",
)

#: Kernel arguments that shorten the guest's boot (kernel-parameters.rst): no crypto self-tests at
#: algorithm registration (``cryptomgr.notests``; FIPS mode ignores it; they were 70 % of the
#: instruction-counted time to ``/init``, QEMU ``-icount``), no check that the timer interrupt
#: arrives through the IO-APIC (``no_timer_check``: a busy-wait of 10 ticks; QEMU delivers it),
#: and lock prefixes left in place on a one-CPU guest (``noreplace-smp``: patching out thousands
#: of them one by one flushed QEMU's TLB 35,000 times per boot; an uncontended lock prefix costs
#: next to nothing).
FAST_BOOT_ARGS = ("cryptomgr.notests", "no_timer_check", "noreplace-smp")


class GuestAssetError(Exception):
    """No usable kernel, or the initramfs could not be built."""


@dataclass(frozen=True)
class GuestBoot:
    """How the guest boots: ``pvh`` (boot the kernel's ELF image at its PVH entry,
    :func:`pvh_image`), ``kernel_args`` (beyond console and panic; :data:`FAST_BOOT_ARGS`),
    ``init`` (the ``/init`` script; ``None``: the packaged one), ``applets`` (busybox applets
    linked in the initramfs; ``None``: all), ``unsigned_modules`` (modules without their
    signatures when the kernel allows it). The defaults are the agent's; the boot benchmark
    also boots the configuration before these trims."""

    pvh: bool = True
    kernel_args: tuple[str, ...] = FAST_BOOT_ARGS
    init: bytes | None = None
    applets: tuple[str, ...] | None = field(default=GUEST_APPLETS)
    unsigned_modules: bool = True
