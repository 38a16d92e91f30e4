"""The agent's side of what a QEMU guest says (pure reader and message, and the bounded file
reader on a real file); the guest's side is tested in real VMs (tests/qemu)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impvm.agent.guest_io import (
    STATUS_LINE_BYTES,
    STATUS_MAX_BYTES,
    STATUS_READ_BYTES,
    GuestReport,
    StatusLog,
    StatusReading,
    config_message,
    hand_over,
    read_status,
)


def _read(chunks: list[bytes]) -> GuestReport:
    state = StatusReading()
    for c in chunks:
        state = read_status(state, c)
    return state.report


def test_only_whole_status_lines_of_the_init_s_shape_count() -> None:
    assert _read([b"IMPVM-STATUS boot\nIMPVM-STATUS runner-start\n"]) == GuestReport(True, True)
    assert _read([b"IMPVM-STATUS exit 3\nIMPVM-STATUS exit 7\n"]).exit_code == 7
    assert _read([b"IMPVM-STATUS exit 3\r\n"]).exit_code == 3
    for junk in (
        b"IMPVM-STATUS exit 256\n",  # no shell status
        b"IMPVM-STATUS exit -1\n",
        b"IMPVM-STATUS exit " + b"9" * 5000 + b"\n",  # int() of it would raise
        b"xIMPVM-STATUS exit 0\n",
        b"IMPVM-STATUS exit 0 trailing\n",
        b"IMPVM-STATUS exit 0",  # not ended
        b"IMPVM-STATUS exit 0IMPVM-STATUS exit 1\n",
    ):
        assert _read([junk]).exit_code is None, junk


def test_an_overlong_line_is_skipped_to_its_end_even_across_chunks() -> None:
    long = b"x" * (STATUS_LINE_BYTES + 1)
    tail = b"IMPVM-STATUS exit 0\n"  # the end of the long line, not a line of its own
    assert _read([long, tail]).exit_code is None
    assert _read([long + b"\nIMPVM-STATUS exit 4\n"]).exit_code == 4


@given(
    st.lists(
        st.sampled_from(
            [b"IMPVM-STATUS boot", b"IMPVM-STATUS exit 1", b"IMPVM-STATUS exit 200", b"noise"]
        ),
        max_size=12,
    ),
    st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_how_the_stream_is_cut_into_chunks_never_changes_the_report(
    lines: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(line + b"\n" for line in lines)
    chunks, last = [], 0
    for c in sorted(min(c, len(data)) for c in cuts):
        chunks.append(data[last:c])
        last = c
    chunks.append(data[last:])
    assert _read(chunks) == _read([data])


def test_a_flood_costs_no_disk_and_hides_no_later_line(tmp_path: Path) -> None:
    """A writer appends far more than a look reads: each look reads only the newest part,
    frees the blocks of what it read, and the line written last is found."""
    path = tmp_path / "status.log"
    log = StatusLog(path)
    with path.open("ab") as f:
        f.write(b"IMPVM-STATUS boot\nIMPVM-STATUS runner-start\n")
        f.flush()
        assert log.poll() == GuestReport(True, True)
        for _ in range(40):  # 40 looks at 256 KiB of forged lines each
            f.write(b"IMPVM-STATUS exit 0\n" * (256 * 1024 // 20))
            f.flush()
            log.poll()
            assert path.stat().st_blocks * 512 <= STATUS_MAX_BYTES + STATUS_READ_BYTES + (256 << 10)
        f.write(b"IMPVM-STATUS exit 5\n")  # the init's, last
    assert path.stat().st_size > 10_000_000  # the writer's offsets run on (a sparse file)
    assert log.drain() == GuestReport(True, True, 5)
    assert StatusLog(path).drain().exit_code == 5  # a new agent process finds it too


def test_the_config_message_refuses_line_breaks() -> None:
    assert config_message(["hostname a"], "eyJ4IjoxfQ==") == (
        b"hostname a\njit eyJ4IjoxfQ==\nend\n"
    )
    for bad in ("a\nb", "a\rb", "a\0b"):
        with pytest.raises(ValueError, match="line break") as err:
            config_message([], bad)
        assert bad not in str(err.value)
    with pytest.raises(ValueError, match="line break"):
        config_message(["share h0 /x\nend"], "jit")


async def test_the_hand_over_is_one_delivery_then_the_channel_is_closed() -> None:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(hand_over(ours, b"jit x\nend\n"))
    got = b""
    while not got.endswith(b"end\n"):
        got += await loop.sock_recv(theirs, 100)
    await loop.sock_sendall(theirs, b"ok\n")
    assert await task is True
    assert await loop.sock_recv(theirs, 100) == b""  # closed for good
    theirs.close()
