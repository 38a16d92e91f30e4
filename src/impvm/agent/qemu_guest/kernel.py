"""The guest kernel (:mod:`impvm.agent.qemu_guest`): the modules the guest init needs, finding a
kernel that has them (:func:`find_kernel`), and their load order from its ``modules.dep``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from impvm.agent.qemu_guest.boot import GuestAssetError

#: Modules the guest init needs (virtio transports, disks, net, the config channel's
#: virtio-serial port, 9p shares, overlay root).
GUEST_MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_net",
    "virtio_console",
    "crc32c_generic",
    "ext4",
    "overlay",
    "9pnet_virtio",
    "9p",
)
_SHARE_MODULES = ("9p", "9pnet_virtio")
#: Modules only a machine with a PCI bus needs (the init skips them when there is none).
_PCI_MODULES = ("virtio_pci",)


@dataclass(frozen=True)
class Kernel:
    """A guest kernel: ``path`` (the bzImage), ``version`` (``uname -r``), ``modules`` (its
    ``/lib/modules/<version>`` directory), ``pvh`` (its ELF image with a PVH entry point,
    :func:`pvh_image`; ``None``: QEMU boots the bzImage)."""

    path: Path
    version: str
    modules: Path
    pvh: Path | None = None

    @property
    def boot_image(self) -> Path:
        """What QEMU's ``-kernel`` loads: the PVH image when there is one, else the bzImage."""
        return self.pvh or self.path

    def has_module(self, name: str) -> bool:
        """Whether ``name`` is a loadable module or built in."""
        return name in _module_index(self.modules)[0] or name in _builtin(self.modules)


def _modname(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    base = re.sub(r"\.ko(\.(xz|gz|zst))?$", "", base)
    return base.replace("-", "_")


def _module_index(moddir: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``(name -> relative path, relative path -> dependency paths)`` from ``modules.dep``."""
    paths: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    try:
        text = (moddir / "modules.dep").read_text()
    except OSError:
        return paths, deps
    for line in text.splitlines():
        mod, _, rest = line.partition(":")
        if not mod:
            continue
        paths[_modname(mod)] = mod
        deps[mod] = rest.split()
    return paths, deps


def _builtin(moddir: Path) -> set[str]:
    try:
        return {_modname(ln) for ln in (moddir / "modules.builtin").read_text().splitlines()}
    except OSError:
        return set()


def find_kernel(
    path: Path | None = None, need_shares: bool = True, modules_root: Path = Path("/lib/modules")
) -> Kernel:
    """The kernel at ``path`` or, when ``None``, the newest ``/boot/vmlinuz-*`` with modules (one
    with 9p modules when ``need_shares``). The version is the file name's suffix after
    ``vmlinuz-``. Raises :class:`GuestAssetError` when none fits (the message names the Debian
    package to install)."""
    candidates = [path] if path else sorted(Path("/boot").glob("vmlinuz-*"), reverse=True)
    problems: list[str] = []
    for cand in candidates:
        version = cand.name.removeprefix("vmlinuz-")
        k = Kernel(cand, version, modules_root / version)
        if not cand.is_file() or not os.access(cand, os.R_OK):
            problems.append(f"{cand}: not a readable file")
            continue
        if not (k.modules / "modules.dep").is_file():
            problems.append(f"{cand}: no {k.modules}/modules.dep")
            continue
        missing = [m for m in GUEST_MODULES if m not in _SHARE_MODULES and not k.has_module(m)]
        if need_shares:
            missing += [m for m in _SHARE_MODULES if not k.has_module(m)]
        if missing:
            problems.append(f"{cand}: lacks modules {', '.join(missing)}")
            continue
        return k
    detail = "; ".join(problems) or "no /boot/vmlinuz-*"
    raise GuestAssetError(f"no usable guest kernel ({detail})")


def module_order(kernel: Kernel, names: tuple[str, ...] = GUEST_MODULES) -> list[str]:
    """Relative module paths to ``insmod`` in order (dependencies first, each once); names that
    are built in or unknown are skipped."""
    paths, deps = _module_index(kernel.modules)
    order: list[str] = []

    def visit(rel: str) -> None:
        if rel in order:
            return
        for d in deps.get(rel, []):
            visit(d)
        order.append(rel)

    for n in names:
        if n in paths:
            visit(paths[n])
    return order


def pci_only_modules(kernel: Kernel) -> list[str]:
    """Relative module paths that only the PCI transport needs (``virtio_pci`` and the
    dependencies no other guest module has)."""
    others = set(module_order(kernel, tuple(m for m in GUEST_MODULES if m not in _PCI_MODULES)))
    return [m for m in module_order(kernel, _PCI_MODULES) if m not in others]
