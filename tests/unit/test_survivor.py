"""The pieces that let a VM outlive its agent, without a VM: a process's identity (pid reuse and
zombies), watching and signalling a process through a pidfd, and scrubbing a JIT config out of a
console tail by its print alone."""

from __future__ import annotations

import asyncio
import signal

from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.agent.survivor import AdoptedProcess, ProcessIdentity, SecretPrint, identity_of


async def test_an_adopted_process_is_watched_and_signalled_through_its_pidfd() -> None:
    proc = await asyncio.create_subprocess_exec("sleep", "300")
    me = identity_of(proc.pid)
    assert me is not None and me.pid == proc.pid
    adopted = AdoptedProcess.open(me)
    assert adopted.returncode is None
    waiting = asyncio.create_task(adopted.wait())
    await asyncio.sleep(0.1)
    assert not waiting.done()
    adopted.terminate()
    assert await asyncio.wait_for(waiting, 10) == 0 and adopted.returncode == 0
    assert await proc.wait() == -signal.SIGTERM
    assert identity_of(proc.pid) is None  # reaped: no such process
    # an identity that no longer runs is an ended process; signalling it is refused
    gone = AdoptedProcess.open(me)
    assert gone.returncode == 0
    try:
        gone.kill()
    except ProcessLookupError:
        pass
    else:
        raise AssertionError("signalled a process that ended")


async def test_a_pid_that_names_another_process_is_not_adopted() -> None:
    proc = await asyncio.create_subprocess_exec("sleep", "300")
    try:
        me = identity_of(proc.pid)
        assert me is not None
        other = ProcessIdentity(pid=me.pid, start=me.start + "0")  # started at another time
        p = AdoptedProcess.open(other)
        assert p.returncode == 0  # taken for ended, never signalled
        assert identity_of(proc.pid) == me
    finally:
        proc.kill()
        await proc.wait()


@settings(max_examples=200, deadline=None)
@given(
    secret=st.text(st.characters(blacklist_characters="*"), min_size=1, max_size=60),
    parts=st.lists(st.text(max_size=40), min_size=1, max_size=5),
)
def test_a_print_scrubs_every_occurrence_and_nothing_else(secret: str, parts: list[str]) -> None:
    p = SecretPrint.of(secret)
    text = secret.join(parts)
    out = p.scrub(text)
    assert secret not in out
    if secret not in text:
        assert out == text
    assert SecretPrint.from_record(p.to_record()) == p
