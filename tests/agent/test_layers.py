"""The layer rules of :mod:`impvm.agent.layers` on their own (pure rules, the stream reader's
guards); the attacks through real images are in test_image_attacks.py."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

import pytest

from impvm.agent.layers import Budget, ImageRefused, entry_problem, scan_layer
from tests.agent import hostile
from tests.agent.hostile import Entry, file


@pytest.mark.parametrize(
    ("name", "kind", "link", "refused"),
    [
        ("etc/passwd", "file", "", False),
        ("/etc/passwd", "file", "", False),  # absolute names are taken from the root
        ("a/../b", "file", "", False),
        ("../etc/passwd", "file", "", True),
        ("a/../../b", "file", "", True),
        ("usr/bin/awk", "symlink", "/etc/alternatives/awk", False),
        ("usr/lib/x/libc.so", "symlink", "../../../lib/libc.so", False),
        ("usr/lib/x/libc.so", "symlink", "../../../../lib/libc.so", True),
        ("a", "symlink", "..", True),
        ("x", "hardlink", "/etc/shadow", False),  # inside the root
        ("x", "hardlink", "../etc/shadow", True),
        ("dev/sda", "blk", "", True),
        ("dev/null", "chr", "", True),
        ("run/fifo", "fifo", "", False),
    ],
)
def test_entry_rules_follow_dockers_breakout_checks(
    name: str, kind: str, link: str, refused: bool
) -> None:
    assert (entry_problem(name, kind, link) is not None) is refused


def _tar(path: Path, entries: list[Entry], tail: bytes = b"") -> Path:
    hostile.write_layer(path, entries)
    with path.open("ab") as f:
        f.write(tail)
    return path


def test_data_after_the_end_of_the_archive_is_refused(tmp_path: Path) -> None:
    """tarfile stops at the first zero block, Go's reader (umoci's) at two: a header hidden
    after one zero block would be unpacked unchecked, so anything but zeros there refuses the
    layer; trailing zero padding is fine."""
    plain = tmp_path / "plain.tar"
    hostile.write_layer(plain, [file("a", "x")])
    data = plain.read_bytes().rstrip(b"\0")
    data += bytes(-len(data) % 512)  # the entry, then exactly one zero block, then a header
    with tarfile.open(tmp_path / "hidden.tar", "w", format=tarfile.USTAR_FORMAT) as t:
        info = tarfile.TarInfo("dev/sda")
        info.type, info.devmajor = tarfile.BLKTYPE, 8
        t.addfile(info)
    hidden = (tmp_path / "hidden.tar").read_bytes()[:512]
    smuggled = tmp_path / "smuggled.tar"
    smuggled.write_bytes(data + bytes(512) + hidden + bytes(1024))
    with pytest.raises(ImageRefused, match="data after the end of its tar archive"):
        scan_layer(smuggled, Budget(1 << 30), "layer")
    padded = _tar(tmp_path / "padded.tar", [file("a", "x")], bytes(10240))
    assert scan_layer(padded, Budget(1 << 30), "layer") == 1


def test_a_huge_header_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A PAX header of 64 MiB (tarfile reads one whole) is refused at its size."""
    path = tmp_path / "pax.tar.gz"
    with gzip.open(path, "wb") as f:
        info = tarfile.TarInfo("a")
        info.pax_headers = {"comment": "x" * (64 << 20)}
        f.write(info.tobuf(tarfile.PAX_FORMAT))
        f.write(bytes(1024))
    with pytest.raises(ImageRefused, match="not a readable tar stream"):
        scan_layer(path, Budget(1 << 40), "layer")
