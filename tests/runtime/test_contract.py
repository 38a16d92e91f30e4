"""The Runtime contract, one suite run against both runtimes: ``process`` (real bubblewrap
sandboxes) and ``qemu`` (real QEMU VMs on the probed accelerator), booting images prepared from a
real registry. What only one runtime does lives with it (tests/agent/test_process.py,
tests/qemu/test_qemu.py)."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest

from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.agent.runtime import Runtime, Secret, VMRequest
from tests.runtime_fixtures import (
    Images,
    files_containing,
    procs_with,
    tail_values,
    vm_request,
    wait_for,
)


@dataclass(frozen=True)
class Case:
    """One runtime under test and what differs by design: ``root_writable``: a write to ``/``
    lands in the VM's own scratch (qemu: overlay) instead of being refused (process: read-only
    root); ``stop_note``: what the console shows when a stop was asked for (qemu: the guest
    init says so); ``seconds``: how long a VM may take to reach a state."""

    rt: Runtime
    memory_mib: int
    seconds: float
    root_writable: bool
    stop_note: str | None = None

    def req(self, tmp_path: Path, name: str, image: str, layer: str | None) -> VMRequest:
        return vm_request(tmp_path, name, image, layer, memory_mib=self.memory_mib)


@pytest.fixture(params=["process", "qemu"])
def case(request: pytest.FixtureRequest, shared_store: ImageStore) -> Case:
    if request.param == "process":
        return Case(ProcessRuntime(shared_store), 256, 30, root_writable=False)
    qemu = request.getfixturevalue("qemu_runtime")
    return Case(qemu, 512, 180, root_writable=True, stop_note="stop requested")


async def test_runs_one_vm_to_its_exit_code_then_forgets_it(
    tmp_path: Path, images: Images, case: Case, request: pytest.FixtureRequest
) -> None:
    rt = case.rt
    assert isinstance(rt, Runtime) and rt.name == request.node.callspec.params["case"]
    req = case.req(tmp_path, "probe", images.base, images.probe)
    assert (await rt.inspect(req)).status == "missing"
    await rt.prepare(req)
    await rt.start(req, Secret("jit-" + secrets.token_hex(8)))
    state = await wait_for(rt, req, seconds=case.seconds)
    assert state.status == "exited" and state.exit_code == 3, state
    assert state.started_at and state.finished_at and state.finished_at >= state.started_at
    out = tail_values(state.log_tail)
    assert out["uname"].startswith("Linux probe "), out  # own host name: the VM's name
    assert out["jit-set"] == "yes" and out["imp"] == "unset" and out["allow-root"] == "1"
    assert out["vmid"] == req.vm_id
    assert out["scratch-before"] == "0,0" and out["scratch-after"] == "1,1"
    # the image is never written: refused, or the write stays in this VM's own scratch
    expect = "writable" if case.root_writable else "readonly"
    assert out["usr"] == expect and out["layer"] == expect, out
    assert out["usr-before"] == "0" and out["usr-after"] == ("1" if case.root_writable else "0")
    assert (req.workdir / "console.log").stat().st_mode & 0o777 == 0o600
    await rt.cleanup(req)
    assert not req.workdir.exists()
    assert (await rt.inspect(req)).status == "missing"
    await rt.cleanup(req)  # idempotent


async def test_concurrent_vms_do_not_share_scratch(
    tmp_path: Path, images: Images, case: Case
) -> None:
    rt = case.rt
    a, b = (case.req(tmp_path, n, images.base, images.probe) for n in ("iso-a", "iso-b"))
    await asyncio.gather(
        rt.start(a, Secret("jit-a-" + secrets.token_hex(8))),
        rt.start(b, Secret("jit-b-" + secrets.token_hex(8))),
    )
    # both were started together; each gets to run its probe
    await asyncio.gather(
        wait_for(rt, a, "scratch-before", case.seconds),
        wait_for(rt, b, "scratch-before", case.seconds),
    )
    states = await asyncio.gather(
        wait_for(rt, a, seconds=case.seconds), wait_for(rt, b, seconds=case.seconds)
    )
    for s in states:
        # Each saw an empty /tmp and _work at start and only its own file after the other wrote.
        out = tail_values(s.log_tail)
        assert out["scratch-before"] == "0,0", s.log_tail
        assert out.get("scratch-after") == "1,1", s.log_tail
        assert out["usr-before"] == "0", s.log_tail
        assert out["usr-after"] == ("1" if case.root_writable else "0"), s.log_tail
    # Neither VM is cleaned up yet; the next VM from the same image still starts clean.
    c = case.req(tmp_path, "iso-c", images.base, images.probe)
    await rt.start(c, Secret("jit-c-" + secrets.token_hex(8)))
    out = tail_values((await wait_for(rt, c, seconds=case.seconds)).log_tail)
    assert out["scratch-before"] == "0,0" and out["usr-before"] == "0"
    for r in (a, b, c):
        await rt.cleanup(r)


async def test_stop_is_graceful_then_kills(tmp_path: Path, images: Images, case: Case) -> None:
    rt = case.rt
    soft = case.req(tmp_path, "sleeper", images.base, images.sleep)
    hard = case.req(tmp_path, "stubborn", images.base, images.stubborn)
    await asyncio.gather(rt.start(soft, Secret("jit-s-x")), rt.start(hard, Secret("jit-h-x")))
    await asyncio.gather(
        wait_for(rt, soft, "ready", case.seconds), wait_for(rt, hard, "ready", case.seconds)
    )
    assert (await rt.inspect(soft)).status == "running"
    await asyncio.gather(rt.stop(soft, grace_seconds=60), rt.stop(hard, grace_seconds=3))
    s, h = await rt.inspect(soft), await rt.inspect(hard)
    # the runner ended by SIGTERM (128 + 15); the SIGKILL fallback would report -1
    assert s.status == "exited" and s.exit_code not in (None, -1, 0), s
    assert s.exit_code == 143, s
    if case.stop_note:
        assert case.stop_note in s.log_tail
    assert h.status == "exited" and h.exit_code == -1, h  # killed after the grace period
    await rt.stop(soft)  # idempotent
    for r in (soft, hard):
        await rt.cleanup(r)
        assert not r.workdir.exists()


async def test_jit_config_reaches_the_runner_only(
    tmp_path: Path, images: Images, case: Case, shared_store: ImageStore
) -> None:
    rt = case.rt
    marker = "jitmarker-" + secrets.token_hex(16)
    req = case.req(tmp_path, "jit", images.base, images.sleep)
    await rt.start(req, Secret(marker))
    state = await wait_for(rt, req, "ready", case.seconds)
    out = tail_values(state.log_tail)
    assert out["sha"] == hashlib.sha256(marker.encode()).hexdigest()  # run.sh saw the value
    assert out["imp"] == "unset"
    assert out["raw"] == "***" and marker not in state.log_tail  # scrubbed
    assert procs_with(marker.encode(), "cmdline") == []  # on no command line
    await rt.stop(req, grace_seconds=30)
    assert marker not in (await rt.inspect(req)).log_tail
    await rt.cleanup(req)
    assert not req.workdir.exists()
    assert files_containing(tmp_path, marker.encode()) == []
    assert files_containing(shared_store.cache_dir, marker.encode()) == []


async def test_empty_jit_config_fails_with_64(tmp_path: Path, images: Images, case: Case) -> None:
    req = case.req(tmp_path, "nojit", images.base, images.probe)
    await case.rt.start(req, Secret(""))
    state = await wait_for(case.rt, req, seconds=case.seconds)
    assert state.exit_code == 64
    assert "IMP_GITHUB_JITCONFIG is empty" in state.log_tail
    await case.rt.cleanup(req)
