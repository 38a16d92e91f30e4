"""Hostile OCI images for the attack tests: layers written entry by entry with ``tarfile`` (so
they can hold what no well-behaved tool writes: ``..`` names, links that leave the root, device
nodes, bombs), stacked with ``umoci raw add-layer`` (which takes a tarball verbatim) and pushed
with ``skopeo`` to the test registry, pinned by digest."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from impvm.agent.tools import run_tool


@dataclass(frozen=True)
class Entry:
    """One tar entry: ``kind`` is ``file``, ``dir``, ``symlink``, ``hardlink``, ``chr``, ``blk``
    or ``zeros`` (a regular file of ``size`` zero bytes, streamed: a bomb costs no memory);
    ``target``: the link target; ``data``: a file's content; ``dev``: (major, minor)."""

    name: str
    kind: str = "file"
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    size: int = 0
    dev: tuple[int, int] = (0, 0)


def file(name: str, data: bytes | str, mode: int = 0o644) -> Entry:
    return Entry(name, "file", data.encode() if isinstance(data, str) else data, mode=mode)


def directory(name: str) -> Entry:
    return Entry(name, "dir", mode=0o755)


def symlink(name: str, target: str) -> Entry:
    return Entry(name, "symlink", target=target, mode=0o777)


def hardlink(name: str, target: str) -> Entry:
    return Entry(name, "hardlink", target=target)


def device(name: str, kind: str, major: int, minor: int) -> Entry:
    return Entry(name, kind, mode=0o666, dev=(major, minor))


def zeros(name: str, size: int) -> Entry:
    return Entry(name, "zeros", size=size)


class Zeros(io.RawIOBase):
    """A stream of ``size`` zero bytes, never held in memory (decompression bombs)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


_TYPES = {
    "file": tarfile.REGTYPE,
    "zeros": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
}


def write_layer(path: Path, entries: Sequence[Entry]) -> None:
    """An uncompressed layer tarball holding exactly ``entries`` (in order, owned by root)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = _TYPES[e.kind]
            info.mode = e.mode
            info.mtime = 1_700_000_000
            info.linkname = e.target
            info.devmajor, info.devminor = e.dev
            if e.kind == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            elif e.kind == "zeros":
                info.size = e.size
                tar.addfile(info, io.BufferedReader(Zeros(e.size), 1 << 20))
            else:
                tar.addfile(info)


async def push_image(
    work: Path, registry: str, repo: str, tag: str, layers: Sequence[Sequence[Entry]]
) -> str:
    """Build an image of ``layers`` (each a list of entries, bottom first) under ``work``, push
    it to ``registry`` as ``repo:tag`` and return ``registry/repo@digest``."""
    await asyncio.to_thread(shutil.rmtree, work, True)
    await asyncio.to_thread(work.mkdir, parents=True)
    layout = work / "oci"
    image = f"{layout}:{tag}"
    await run_tool("umoci init", "umoci", "init", "--layout", str(layout))
    await run_tool("umoci new", "umoci", "new", "--image", image)
    for i, entries in enumerate(layers):
        tar = work / f"layer{i}.tar"
        await asyncio.to_thread(write_layer, tar, entries)
        await run_tool(
            "umoci raw add-layer", "umoci", "raw", "add-layer", "--image", image, str(tar)
        )
        tar.unlink()
    digest_file = work / "digest"
    await run_tool(
        "skopeo copy",
        "skopeo",
        "copy",
        "--quiet",
        "--dest-tls-verify=false",
        "--digestfile",
        str(digest_file),
        f"oci:{image}",
        f"docker://{registry}/{repo}:{tag}",
    )
    return f"{registry}/{repo}@{digest_file.read_text().strip()}"


def busybox_base() -> list[Entry]:
    """A minimal runnable base layer: busybox with the applets the test runners use, /etc/passwd
    with the runner user, and the directories the runtimes mount into."""
    busybox = Path("/bin/busybox").read_bytes()
    out = [directory(d) for d in ("bin", "etc", "usr", "usr/local", "usr/local/bin", "home")]
    out += [directory("home/runner"), directory("home/runner/_work"), directory("tmp")]
    out += [directory("proc"), directory("dev"), directory("sys"), directory("root")]
    out.append(file("bin/busybox", busybox, 0o755))
    for applet in ("sh", "cat", "echo", "ls", "sleep", "head", "mkdir", "touch"):
        out.append(symlink(f"bin/{applet}", "busybox"))
    out.append(
        file(
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nrunner:x:10001:10001::/home/runner:/bin/sh\n",
        )
    )
    return out


def walk_host(root: Path) -> Iterator[Path]:
    """Every path below ``root`` (for "nothing was written here" checks)."""
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            yield Path(dirpath) / name
