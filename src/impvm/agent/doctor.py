"""Host preflight (``impvm doctor``, also run by the agent at start): can this host run VMs
with the chosen runtime? One :class:`Check` per requirement, each failed one saying in one line
what to install or fix (the Debian package, the device, the setting).

- both runtimes: ``skopeo`` and ``umoci`` (image pull and unpack) at their versions; free disk
  in the work directory; ``nft`` when guests are isolated (``--guest-network isolated``), and a
  warning when they are not (``unisolated``);
- ``qemu``: ``qemu-system-x86_64``; a usable guest kernel; ``/dev/kvm`` and, with ``probe``, a
  real probe boot (KVM, else TCG: slow but working);
- ``process``: ``bwrap`` and the user, pid, ipc, uts and cgroup namespaces it makes (a real
  sandbox runs ``true``).

:func:`verdict` (pure) turns the checks into the agent's :class:`~impvm.agent.lifecycle.
Preflight`: an agent whose runtime cannot work admits no VMs, and its Lease says why
(annotation ``imp.dev/preflight``).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from impvm.agent.lifecycle import Preflight
from impvm.agent.network import ISOLATED, UNISOLATED, UNISOLATED_WARNING

#: below this free space in the work directory no image fits (bytes)
MIN_FREE_BYTES = 2 * 1024**3
#: below this, a warning (images and scratch disks fill it quickly)
LOW_FREE_BYTES = 10 * 1024**3
#: how much of the failed checks the Lease annotation carries
LEASE_CHARS = 1000

TOOLS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "skopeo": "skopeo",
    "umoci": "umoci",
    "bwrap": "bubblewrap",
    "nft": "nftables",
}


@dataclass(frozen=True)
class Check:
    """One requirement: ``ok``, what was found (``detail``), the one-line ``fix`` when it
    failed, and whether the runtime cannot work without it (``required``)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def verdict(checks: Sequence[Check]) -> Preflight:
    """The agent's gate: ok when every required check passed; ``reason`` names the failed
    ones with their fixes. Pure."""
    failed = [c for c in checks if c.required and not c.ok]
    warned = "; ".join(f"{c.name}: {c.detail}" for c in checks if not c.required and not c.ok)
    if not failed:
        return Preflight(warning=warned)
    reason = "; ".join(f"{c.name}: {c.detail} ({c.fix})" for c in failed)
    return Preflight(ok=False, reason=reason, warning=warned)


def lease_value(preflight: Preflight) -> str:
    """The ``imp.dev/preflight`` annotation: ``ok`` or ``failed: <reason>``, followed by
    ``; warning: <warnings>`` when a check warned (bounded)."""
    text = "ok" if preflight.ok else f"failed: {preflight.reason}"
    if preflight.warning:
        text += f"; warning: {preflight.warning}"
    return text[:LEASE_CHARS]


def lines(checks: Sequence[Check]) -> list[str]:
    """What ``impvm doctor`` prints: one line per check, a failed one with its fix."""
    out = []
    for c in checks:
        if c.ok:
            out.append(f"ok    {c.name}: {c.detail}")
        else:
            word = "FAIL " if c.required else "warn "
            out.append(f"{word} {c.name}: {c.detail} -> {c.fix}")
    return out


def as_dicts(checks: Sequence[Check]) -> list[dict[str, object]]:
    """``-o json``."""
    return [asdict(c) for c in checks]


async def _run(*args: str, limit_seconds: float = 30.0) -> tuple[int, str]:
    """Exit code and combined output of a command (127 when it cannot be started)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as e:
        return 127, str(e)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), limit_seconds)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"no answer within {limit_seconds:.0f}s"
    return proc.returncode or 0, out.decode(errors="replace").strip()


async def tool(name: str, required: bool = True) -> Check:
    """``name`` is on PATH and answers ``--version`` (its first line is the detail)."""
    package = TOOLS.get(name, name)
    path = shutil.which(name)
    if path is None:
        return Check(name, False, "not found on PATH", f"apt-get install {package}", required)
    code, out = await _run(path, "--version")
    first = out.splitlines()[0] if out else ""
    if code != 0:
        return Check(
            name,
            False,
            f"{path} --version exited {code}: {first}",
            f"reinstall {package}",
            required,
        )
    return Check(name, True, f"{first} ({path})", required=required)


def disk(workdir: Path) -> Check:
    """Free space where images and scratch disks go."""
    probe = workdir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    gib = free / 1024**3
    if free < MIN_FREE_BYTES:
        return Check(
            "disk", False, f"{gib:.1f} GiB free in {workdir}", "free space or use another --workdir"
        )
    if free < LOW_FREE_BYTES:
        return Check(
            "disk", True, f"{gib:.1f} GiB free in {workdir} (low: images and VM disks need more)"
        )
    return Check("disk", True, f"{gib:.1f} GiB free in {workdir}")


async def namespaces(bwrap: str = "bwrap") -> Check:
    """bubblewrap can make the namespaces the process runtime uses (a real sandbox)."""
    path = shutil.which(bwrap)
    if path is None:
        return Check("namespaces", False, "bwrap not found", "apt-get install bubblewrap")
    args = [path, "--unshare-all", "--share-net", "--die-with-parent", "--ro-bind", "/", "/"]
    code, out = await _run(*args, "--proc", "/proc", "--dev", "/dev", "true")
    if code != 0:
        return Check(
            "namespaces",
            False,
            f"bwrap --unshare-all failed ({code}): {out[:200]}",
            "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces>0) or run the agent as root",
        )
    v2 = await asyncio.to_thread(Path("/sys/fs/cgroup/cgroup.controllers").exists)
    kind = "cgroup v2" if v2 else "cgroup v1 (no limits for the process runtime)"
    return Check("namespaces", True, f"user, pid, ipc, uts, cgroup namespaces; {kind}")


def guest_kernel(path: Path | None) -> Check:
    """A kernel the qemu runtime can boot (:func:`impvm.agent.qemu_guest.find_kernel`)."""
    from impvm.agent.qemu_guest import GuestAssetError, find_kernel

    try:
        k = find_kernel(path, need_shares=False)
    except GuestAssetError as e:
        return Check(
            "guest kernel",
            False,
            str(e)[:300],
            "apt-get install linux-image-amd64, or name a kernel: impvm agent --qemu-kernel "
            "PATH (impvm up: agent.qemuKernel)",
        )
    return Check("guest kernel", True, str(k.path))


async def kvm(workdir: Path, kernel: Path | None, probe: bool) -> list[Check]:
    """``/dev/kvm`` usable, and (``probe``) which accelerator really boots a guest."""
    from impvm.agent.qemu_accel import AcceleratorError, detect_accelerator, kvm_usable
    from impvm.agent.qemu_guest import GuestAssetError, build_initramfs, find_kernel

    why = kvm_usable()
    out = [
        Check(
            "kvm",
            why is None,
            "/dev/kvm opens read-write" if why is None else why,
            "load kvm_intel/kvm_amd, enable virtualization in the firmware, and give the agent "
            "/dev/kvm (group kvm, or the device in its pod); VMs run under TCG (slow) meanwhile",
            required=False,
        )
    ]
    if not probe or shutil.which("qemu-system-x86_64") is None:
        return out
    try:
        k = find_kernel(kernel, need_shares=False)
        initramfs = await build_initramfs(k, workdir / "qemu" / "guest")
        choice = await detect_accelerator("qemu-system-x86_64", k.path, initramfs)
    except (GuestAssetError, AcceleratorError, OSError) as e:
        out.append(Check("probe boot", False, str(e)[:300], "see the kvm and guest kernel checks"))
        return out
    took = f"{choice.accel}/{choice.machine} in {choice.boot_seconds:.1f}s"
    out.append(Check("probe boot", True, took))
    if choice.accel == "tcg" and why is None:
        out.append(
            Check(
                "kvm boot",
                False,
                f"/dev/kvm opens but no guest boots under KVM: {choice.reason}"[:400],
                "check the host's KVM (nested virtualization, kvm module parameters); "
                "VMs run under TCG (slow) meanwhile",
                required=False,
            )
        )
    return out


def unisolated() -> Check:
    """The warning of ``--guest-network unisolated``: not a failure (development runs like
    this), but shown wherever the checks are (``impvm doctor``, the agent's Lease)."""
    detail = f"unisolated: {UNISOLATED_WARNING}"
    return Check("guest network", False, detail, "--guest-network isolated", False)


async def run_checks(
    runtime: str,
    workdir: Path,
    *,
    qemu_kernel: Path | None = None,
    guest_network: str = "isolated",
    probe: bool = True,
) -> list[Check]:
    """Every check for ``runtime`` (``qemu`` or ``process``). ``probe``: boot a probe guest
    (qemu; seconds under KVM, up to a minute under TCG)."""
    checks: list[Check] = []
    if runtime == "qemu":
        checks.append(await tool("qemu-system-x86_64"))
    else:
        checks.append(await tool("bwrap"))
    checks += [await tool("skopeo"), await tool("umoci")]
    if guest_network == ISOLATED:
        checks.append(await tool("nft"))
    elif guest_network == UNISOLATED:
        checks.append(unisolated())
    checks.append(disk(workdir))
    if runtime == "qemu":
        checks.append(guest_kernel(qemu_kernel))
        checks += await kvm(workdir, qemu_kernel, probe)
    else:
        checks.append(await namespaces())
    return checks
