"""Keeping a failed VM's console: bounded, JIT config scrubbed, mode 0600, the oldest
beyond the node's bound removed."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from impvm.agent.runtime_base import keep_console

SECRET = "eyJqaXQiOiJub3QtcmVhbCJ9"


def test_small_console_is_copied_scrubbed(tmp_path: Path) -> None:
    src = tmp_path / "console.log"
    src.write_bytes(f"boot\nconfig {SECRET}\ndone\n".encode())
    dest = tmp_path / "kept" / "a.log"
    assert keep_console(src, dest, SECRET)
    assert dest.read_bytes() == b"boot\nconfig ***\ndone\n"
    assert dest.stat().st_mode & 0o777 == 0o600
    assert not keep_console(tmp_path / "none.log", tmp_path / "kept" / "b.log", SECRET)


def test_large_console_keeps_head_and_end(tmp_path: Path) -> None:
    src = tmp_path / "console.log"
    lines = [f"line {i:06d} {SECRET}" for i in range(20000)]
    src.write_text("\n".join(lines) + "\n")
    dest = tmp_path / "kept" / "a.log"
    keep_console(src, dest, SECRET, limit=64 * 1024, head=8 * 1024)
    data = dest.read_bytes()
    assert len(data) <= 64 * 1024 + 100
    assert data.startswith(b"line 000000 ***\n") and data.endswith(b"line 019999 ***\n")
    assert SECRET.encode() not in data and b"bytes cut ...]\n" in data
    # cut at line boundaries: every line is whole
    assert all(ln.startswith((b"line ", b"[... ")) for ln in data.splitlines())


def test_oldest_kept_consoles_go(tmp_path: Path) -> None:
    src = tmp_path / "console.log"
    src.write_text("x\n")
    kept = tmp_path / "kept"
    for i in range(7):
        keep_console(src, kept / f"vm{i}.log", None, keep_files=5)
    assert sorted(p.name for p in kept.glob("*.log")) == [f"vm{i}.log" for i in range(2, 7)]


@given(st.binary(max_size=5000), st.integers(200, 2000))
def test_never_longer_than_the_bound_plus_the_marker(data: bytes, limit: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src, dest = Path(d) / "c.log", Path(d) / "k" / "c.log"
        src.write_bytes(data)
        keep_console(src, dest, SECRET, limit=limit, head=limit // 4)
        assert len(dest.read_bytes()) <= limit + 40


def test_a_running_console_is_compacted_in_place_and_writers_keep_appending(
    tmp_path: Path,
) -> None:
    """A real writer (a shell appending, as bwrap's stdout and QEMU's append=on do) keeps
    writing after the file was compacted under it: its later lines follow the kept text."""
    import os
    import subprocess

    from impvm.agent.runtime_base import compact_console

    path = tmp_path / "console.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    script = (
        'i=0; while [ $i -lt 5000 ]; do echo "early line $i ........................"; '
        "i=$((i+1)); done"
    )
    subprocess.run(["sh", "-c", script], stdout=fd, check=True)
    before = path.stat().st_size
    assert before > 128 * 1024
    assert compact_console(path, limit=128 * 1024, tail=16 * 1024)
    # the first 64 KiB (the boot), a marker, the last 16 KiB
    assert path.stat().st_size <= 80 * 1024 + 100
    assert not compact_console(path, limit=128 * 1024, tail=16 * 1024)  # already small
    subprocess.run(["sh", "-c", "echo late line"], stdout=fd, check=True)
    os.close(fd)
    data = path.read_bytes()
    assert data.startswith(b"early line 0 ") and b"bytes cut ...]\n" in data
    assert data.endswith(b"early line 4999 ........................\nlate line\n")
    assert b"\0" not in data  # appended at the end, not at the writer's old offset
