"""The pieces that let a VM outlive its agent, without a VM: a process's identity (pid reuse and
zombies), watching and signalling a process through a pidfd, and scrubbing a JIT config out of a
console tail by its print alone."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.agent.qemu.sandbox import VM_SLICE, scope_prefix
from impvm.agent.qemu.startup import _cached_choice, _probe_key, _write_choice
from impvm.agent.qemu_accel import AccelChoice
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
    secret=st.text(
        st.characters(blacklist_characters="*", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=60,
    ),
    parts=st.lists(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), max_size=5, min_size=1
    ),
)
def test_a_print_scrubs_every_occurrence_and_nothing_else(secret: str, parts: list[str]) -> None:
    p = SecretPrint.of(secret)
    text = secret.join(parts)
    out = p.scrub(text)
    assert secret not in out
    if secret not in text:
        assert out == text
    assert SecretPrint.from_record(p.to_record()) == p


def test_a_vm_scope_is_one_unit_per_vm_in_the_vm_slice() -> None:
    words = scope_prefix("default.ci-pool-0a1b2-123456.0123abcd")
    assert words[:2] == ["systemd-run", "--scope"] and words[-1] == "--"
    assert f"--slice={VM_SLICE}" in words and "--collect" in words
    (unit,) = [w for w in words if w.startswith("--unit=")]
    assert re.fullmatch(r"--unit=impvm-vm-[0-9a-f]{16}", unit)
    assert scope_prefix("other.vm.00000000") != words


def test_the_accelerator_choice_is_reused_only_for_the_same_inputs(tmp_path: Path) -> None:
    kernel, initramfs = tmp_path / "vmlinuz", tmp_path / "initrd"
    kernel.write_bytes(b"k")
    initramfs.write_bytes(b"i")
    key = _probe_key("sh", kernel, initramfs, "auto")
    cache = tmp_path / "accelerator.json"
    assert _cached_choice(cache, key) is None
    _write_choice(cache, key, AccelChoice("kvm", "microvm", "kvm/microvm: probe boot in 1.0s", 1.0))
    got = _cached_choice(cache, key)
    assert got is not None and (got.accel, got.machine, got.boot_seconds) == ("kvm", "microvm", 1.0)
    assert "probed earlier this boot" in got.reason
    assert _probe_key("sh", kernel, initramfs, "tcg") != key
    initramfs.write_bytes(b"rebuilt")
    assert _cached_choice(cache, _probe_key("sh", kernel, initramfs, "auto")) is None


async def test_a_launched_child_is_reaped_with_its_exit_status() -> None:
    p = AdoptedProcess.launch(["sh", "-c", "exit 7"], start_new_session=True)
    assert await asyncio.wait_for(p.wait(), 10) == 7 and p.returncode == 7
    assert identity_of(p.pid) is None  # reaped, not left a zombie
