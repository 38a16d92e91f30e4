"""The guest's boot assets, from the host's real Debian kernels and busybox (scripts/setup.sh
installs linux-image-amd64, linux-image-cloud-amd64 and busybox-static): the PVH image taken out
of a bzImage, module signatures dropped only where the kernel does not require them, and an
initramfs that links just the applets the init runs and lists the PCI-only modules apart."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import lzma
import re
import stat
import struct
from pathlib import Path

import pytest

from impvm.agent.qemu_guest import (
    GUEST_APPLETS,
    GUEST_MODULES,
    GuestAssetError,
    Kernel,
    build_initramfs,
    extract_vmlinux,
    find_kernel,
    module_order,
    module_signatures_required,
    pci_only_modules,
    pvh_image,
    unsigned_module,
)

_SIG = b"~Module signature appended~\n"


def _kernels() -> list[Kernel]:
    found = []
    for image in sorted(Path("/boot").glob("vmlinuz-*")):
        try:
            found.append(find_kernel(image, need_shares=False))
        except GuestAssetError:
            continue
    if not found:
        pytest.fail("no Debian kernel in /boot (scripts/setup.sh installs them)", pytrace=False)
    return found


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k.version)
def test_the_pvh_image_is_the_kernels_elf_with_its_size_and_entry(kernel: Kernel) -> None:
    bz = kernel.path.read_bytes()
    elf = extract_vmlinux(bz)
    assert elf[:4] == b"\x7fELF" and elf[4] == 2  # ELF64
    # the kernel build appends the uncompressed size to the compressed payload
    setup_sects = bz[0x1F1] or 4
    off, length = struct.unpack_from("<II", bz, 0x248)
    start = (setup_sects + 1) * 512 + off
    (size,) = struct.unpack_from("<I", bz, start + length - 4)
    assert len(elf) == size
    assert kernel.version.encode() in elf  # the same kernel, not some other ELF


def test_a_bzimage_that_cannot_boot_at_a_pvh_entry_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="not a bzImage"):
        extract_vmlinux(b"\0" * 4096)
    bz = bytearray(_kernels()[0].path.read_bytes())
    setup_sects = bz[0x1F1] or 4
    off, _ = struct.unpack_from("<II", bz, 0x248)
    start = (setup_sects + 1) * 512 + off
    # an ELF without notes, compressed as the kernel build would (gzip, then xz)
    plain = b"\x7fELF\x02\x01\x01" + b"\0" * 57
    for packed in (gzip.compress(plain), lzma.compress(plain, lzma.FORMAT_XZ)):
        fake = bytearray(bz[:start]) + packed + struct.pack("<I", len(plain))
        struct.pack_into("<I", fake, 0x24C, len(packed) + 4)
        with pytest.raises(ValueError, match="no PVH entry point"):
            extract_vmlinux(bytes(fake))
    fake = bytearray(bz[:start]) + b"\x89LZO" + b"\0" * 60
    struct.pack_into("<I", fake, 0x24C, 64)
    with pytest.raises(ValueError, match="compression unknown"):
        extract_vmlinux(bytes(fake))


async def test_pvh_image_is_built_once_and_a_kernel_without_one_keeps_its_bzimage(
    tmp_path: Path,
) -> None:
    kernel = _kernels()[0]
    k, why = await pvh_image(kernel, tmp_path)
    assert why is None and k.pvh is not None and k.boot_image == k.pvh
    assert stat.S_IMODE(k.pvh.stat().st_mode) == 0o644
    mtime = k.pvh.stat().st_mtime_ns
    again, _ = await pvh_image(kernel, tmp_path)
    assert again.pvh == k.pvh and k.pvh.stat().st_mtime_ns == mtime
    # a cached image cut short (a full disk, a crash) is built again, not booted
    whole = k.pvh.read_bytes()
    k.pvh.write_bytes(whole[:4096])
    rebuilt, why = await pvh_image(kernel, tmp_path)
    assert why is None and rebuilt.pvh == k.pvh and k.pvh.read_bytes() == whole
    # not a bzImage: it stays as it is, and says why
    junk = tmp_path / "vmlinuz-junk"
    junk.write_bytes(b"\0" * 8192)
    other = dataclasses.replace(kernel, path=junk)
    same, why = await pvh_image(other, tmp_path / "other")
    assert same.pvh is None and same.boot_image == junk and why and "not a bzImage" in why


def test_module_signature_is_cut_exactly() -> None:
    body = b"\x7fELF module body"
    signature = b"S" * 37
    info = b"\0" * 8 + struct.pack(">I", len(signature))  # struct module_signature
    assert unsigned_module(body + signature + info + _SIG) == body
    assert unsigned_module(body) == body
    # a real signed module of the host's kernel
    kernel = _kernels()[0]
    rel = next(r for r in module_order(kernel) if r.endswith(".ko"))
    ko = (kernel.modules / rel).read_bytes()
    cut = unsigned_module(ko)
    assert ko.endswith(_SIG) and len(cut) < len(ko) and ko.startswith(cut)
    assert cut[:4] == b"\x7fELF" and _SIG not in cut


def test_signatures_stay_when_the_kernel_requires_them_or_says_nothing(tmp_path: Path) -> None:
    image = tmp_path / "vmlinuz-9.9"
    image.write_bytes(b"")
    k = Kernel(image, "9.9", tmp_path)
    assert module_signatures_required(k)  # no config file: assumed required
    (tmp_path / "config-9.9").write_text("CONFIG_MODULE_SIG=y\nCONFIG_MODULE_SIG_FORCE=y\n")
    assert module_signatures_required(k)
    (tmp_path / "config-9.9").write_text(
        "CONFIG_MODULE_SIG=y\n# CONFIG_MODULE_SIG_FORCE is not set\n"
    )
    assert not module_signatures_required(k)


def _cpio_entries(data: bytes) -> dict[str, tuple[int, bytes]]:
    """``name -> (mode, data)`` of a newc archive."""
    out: dict[str, tuple[int, bytes]] = {}
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701"
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name_end = pos + 110 + namesize
        name = data[pos + 110 : name_end - 1].decode()
        body = (name_end + 3) // 4 * 4
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, data[body : body + size])
        pos = (body + size + 3) // 4 * 4


async def test_initramfs_links_the_init_applets_and_lists_pci_modules_apart(
    tmp_path: Path,
) -> None:
    kernel = _kernels()[0]
    path = await build_initramfs(kernel, tmp_path)
    entries = _cpio_entries(path.read_bytes())
    links = {n.removeprefix("bin/") for n, (m, _) in entries.items() if stat.S_ISLNK(m)}
    assert links == set(GUEST_APPLETS)
    listed = entries["etc/imp/modules"][1].decode().split()
    pci = entries["etc/imp/modules-pci"][1].decode().split()
    assert listed == module_order(kernel) and pci == pci_only_modules(kernel)
    assert pci and set(pci) < set(listed) and any("virtio_pci" in p for p in pci)
    assert not any("virtio_mmio" in p or "virtio_blk" in p for p in pci)
    ko = entries[f"lib/modules/{listed[0]}"][1]
    assert ko.endswith(_SIG) == module_signatures_required(kernel)
    # every applet on request, and signatures kept
    full = await build_initramfs(kernel, tmp_path, applets=None, unsigned_modules=False)
    assert full != path
    entries = _cpio_entries(full.read_bytes())
    assert sum(stat.S_ISLNK(m) for m, _ in entries.values()) > 3 * len(GUEST_APPLETS)
    assert entries[f"lib/modules/{listed[0]}"][1].endswith(_SIG)
    with pytest.raises(GuestAssetError, match="lacks the applets no-such-applet"):
        await build_initramfs(kernel, tmp_path, applets=("sh", "no-such-applet"))


def test_the_init_runs_only_linked_applets() -> None:
    """Every command word the guest init starts is a shell builtin or a linked applet."""
    from impvm.agent.qemu_guest import init_script

    builtins = {
        "export", "exec", "if", "then", "else", "fi", "for", "do", "done", "while", "until",
        "case", "esac", "in", "read", "echo", "set", "unset", "cd", "wait", "return", "break",
        "continue", "[", "test", ":", "say", "status", "die", "exit", "true", "false", "trap",
        "command",
    }  # fmt: skip
    words = set()
    for line in init_script().decode().splitlines():
        code = re.sub(r"\$\(\([^)]*\)\)", "0", line.split("#", 1)[0].strip())  # arithmetic
        for sep in ("$(", "&&", "||", "|"):
            code = code.replace(sep, ";")
        for part in code.split(";"):
            toks = part.strip().lstrip("(").split()
            while toks and (toks[0] == "exec" or ("=" in toks[0] and toks[0][0] not in '="')):
                toks = toks[1:]  # variable assignments, exec: the command follows
            if toks and toks[0].isidentifier() and not toks[0].endswith(")"):
                words.add(toks[0])
    unknown = words - builtins - set(GUEST_APPLETS)
    assert not unknown, unknown


def test_pvh_image_reports_a_kernel_it_cannot_read(tmp_path: Path) -> None:
    k = Kernel(tmp_path / "missing", "0", tmp_path)
    with pytest.raises(GuestAssetError, match="reading the guest kernel failed"):
        asyncio.run(pvh_image(k, tmp_path))


async def test_a_pvh_image_that_boots_nowhere_is_dropped_for_the_bzimage(tmp_path: Path) -> None:
    """A QEMU that cannot start the kernel's ELF image (a stand-in for the qemu binary: it boots
    only a bzImage) leaves the runtime on the bzImage, after probing both machines."""
    from impvm.agent.images import ImageStore
    from impvm.agent.qemu import create_qemu_runtime

    log = tmp_path / "probes"
    qemu = tmp_path / "qemu-system-x86_64"
    qemu.write_text(
        "#!/bin/sh\n"
        'k=; m=; while [ $# -gt 0 ]; do case "$1" in -kernel) k=$2 ;; -machine) m=$2 ;; esac; '
        "shift; done\n"
        f'echo "$m ${{k##*/}}" >>{log}\n'
        'case "${k##*/}" in vmlinux-*) echo "cannot boot $k"; exit 1 ;; esac\n'
        'echo "IMPVM-PROBE-OK fake"\n'
    )
    qemu.chmod(0o755)
    store = ImageStore(tmp_path / "cache", 1 << 20, set())
    rt = await create_qemu_runtime(store, tmp_path / "state", accelerator="tcg", qemu=str(qemu))
    assert rt.kernel.pvh is None and rt.kernel.boot_image == rt.kernel.path
    assert rt.accel.machine == "microvm"
    probes = log.read_text().split("\n")
    assert [p.split()[0] for p in probes[:3]] == ["microvm", "q35", "microvm"], probes
    assert probes[0].split()[1].startswith("vmlinux-")
    assert probes[2].split()[1] == rt.kernel.path.name


def test_a_kernel_needs_the_config_channel_driver_and_may_have_fw_cfg_built_in(
    tmp_path: Path,
) -> None:
    """The JIT config arrives over a virtio-serial port, so a kernel without virtio_console is
    no guest kernel; fw_cfg holds nothing of a VM's any more, so a kernel with its driver built
    in is one."""
    version = "6.1.0-test"
    image = tmp_path / f"vmlinuz-{version}"
    image.write_bytes(b"not booted here")
    moddir = tmp_path / "modules" / version
    moddir.mkdir(parents=True)
    (moddir / "modules.dep").write_text("")
    builtin = [f"kernel/drivers/x/{m}.ko" for m in GUEST_MODULES]
    without = "\n".join(b for b in builtin if "virtio_console" not in b) + "\n"
    (moddir / "modules.builtin").write_text(without)
    with pytest.raises(GuestAssetError, match="lacks modules virtio_console"):
        find_kernel(image, need_shares=True, modules_root=tmp_path / "modules")
    (moddir / "modules.builtin").write_text(
        "\n".join([*builtin, "kernel/drivers/firmware/qemu_fw_cfg.ko"]) + "\n"
    )
    assert (
        find_kernel(image, need_shares=True, modules_root=tmp_path / "modules").version == version
    )
