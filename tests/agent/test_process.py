"""ProcessRuntime: real bubblewrap sandboxes running images prepared from a real registry."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.agent.runtime import Runtime, Secret, VMRequest, VMState

from .conftest import Images


def _req(tmp_path: Path, name: str, image: str, layer: str | None) -> VMRequest:
    return VMRequest(
        vm_id=f"test.{name}.0000",
        name=name,
        namespace="test",
        image=image,
        runner_layer=layer,
        allow_unpinned_images=False,
        vcpu=1,
        memory_mib=256,
        disk_gib=1,
        workdir=tmp_path / "vms" / name,
    )


async def _wait_for(rt: ProcessRuntime, req: VMRequest, pred: str | None = None) -> VMState:
    """Poll until the VM exited (pred None) or its log tail contains ``pred``."""
    for _ in range(300):
        state = await rt.inspect(req)
        if (pred is None and state.status == "exited") or (pred and pred in state.log_tail):
            return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out; last state {state}")


def _lines(tail: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in tail.splitlines() if "=" in line)


@pytest.fixture
def runtime(shared_store: ImageStore) -> ProcessRuntime:
    return ProcessRuntime(shared_store)


async def test_runner_exit_code_and_sandbox_shape(
    tmp_path: Path, images: Images, runtime: ProcessRuntime
) -> None:
    assert isinstance(runtime, Runtime) and runtime.name == "process"
    req = _req(tmp_path, "probe", images.base, images.probe)
    assert (await runtime.inspect(req)).status == "missing"
    await runtime.prepare(req)
    await runtime.start(req, Secret("jit-" + secrets.token_hex(8)))
    state = await _wait_for(runtime, req)
    assert state.status == "exited" and state.exit_code == 3, state
    assert state.started_at and state.finished_at and state.finished_at >= state.started_at
    out = _lines(state.log_tail)
    assert out["uname"].startswith("Linux probe ")  # own UTS namespace, hostname from the VM name
    assert out["jit-set"] == "yes" and out["imp"] == "unset" and out["allow-root"] == "1"
    assert out["usr"] == "readonly" and out["layer"] == "readonly"
    assert out["before"] == "0,0" and out["after"] == "1,1"
    log = req.workdir / "console.log"
    assert log.stat().st_mode & 0o777 == 0o600
    await runtime.cleanup(req)
    assert not req.workdir.exists()
    assert (await runtime.inspect(req)).status == "missing"
    await runtime.cleanup(req)  # idempotent


async def test_concurrent_vms_do_not_share_scratch(
    tmp_path: Path, images: Images, runtime: ProcessRuntime
) -> None:
    a, b = (_req(tmp_path, n, images.base, images.probe) for n in ("iso-a", "iso-b"))
    await asyncio.gather(
        runtime.start(a, Secret("jit-a-" + secrets.token_hex(8))),
        runtime.start(b, Secret("jit-b-" + secrets.token_hex(8))),
    )
    states = await asyncio.gather(_wait_for(runtime, a), _wait_for(runtime, b))
    for s in states:
        # Each saw an empty /tmp and _work at start and only its own file after the other wrote.
        assert _lines(s.log_tail)["before"] == "0,0", s.log_tail
        assert _lines(s.log_tail).get("after") == "1,1", s.log_tail
    # Neither VM is cleaned up yet; the next VM from the same image still starts clean.
    c = _req(tmp_path, "iso-c", images.base, images.probe)
    await runtime.start(c, Secret("jit-c-" + secrets.token_hex(8)))
    assert _lines((await _wait_for(runtime, c)).log_tail)["before"] == "0,0"
    for r in (a, b, c):
        await runtime.cleanup(r)


async def test_stop_terminates_within_grace(
    tmp_path: Path, images: Images, runtime: ProcessRuntime
) -> None:
    req = _req(tmp_path, "sleeper", images.base, images.sleep)
    await runtime.start(req, Secret("jit-x-" + secrets.token_hex(8)))
    await _wait_for(runtime, req, "ready")
    assert (await runtime.inspect(req)).status == "running"
    await runtime.stop(req, grace_seconds=30)
    state = await runtime.inspect(req)
    # Ended by SIGTERM (the SIGKILL fallback would report -1).
    assert state.status == "exited" and state.exit_code not in (None, -1, 0), state
    await runtime.stop(req)  # idempotent
    await runtime.cleanup(req)


async def test_stop_kills_after_grace(
    tmp_path: Path, images: Images, runtime: ProcessRuntime
) -> None:
    req = _req(tmp_path, "stubborn", images.base, images.stubborn)
    await runtime.start(req, Secret("jit-x-" + secrets.token_hex(8)))
    await _wait_for(runtime, req, "ready")
    await runtime.stop(req, grace_seconds=0.5)
    state = await runtime.inspect(req)
    assert state.status == "exited" and state.exit_code == -1, state
    await runtime.cleanup(req)


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                try:
                    if needle in p.read_bytes():
                        found.append(p)
                except OSError:
                    pass
    return found


async def test_jit_config_reaches_runner_only(
    tmp_path: Path, images: Images, runtime: ProcessRuntime, shared_store: ImageStore
) -> None:
    marker = "jitmarker-" + secrets.token_hex(16)
    req = _req(tmp_path, "jit", images.base, images.sleep)
    await runtime.start(req, Secret(marker))
    state = await _wait_for(runtime, req, "ready")
    out = _lines(state.log_tail)
    assert out["sha"] == hashlib.sha256(marker.encode()).hexdigest()  # run.sh saw the value
    assert out["imp"] == "unset"
    assert out["raw"] == "***" and marker not in state.log_tail  # scrubbed
    # No command line of any process shows it (bwrap gets it through its environment) ...
    assert _procs_with(marker.encode(), "cmdline") == []
    # ... while it is in the sandbox's environment (that is how it is delivered), which proves
    # the scan looks at the right processes.
    assert _procs_with(marker.encode(), "environ") != []
    await runtime.stop(req, grace_seconds=5)
    assert marker not in (await runtime.inspect(req)).log_tail
    await runtime.cleanup(req)
    assert not req.workdir.exists()
    assert _files_containing(tmp_path, marker.encode()) == []
    assert _files_containing(shared_store.cache_dir, marker.encode()) == []


def _procs_with(needle: bytes, what: str) -> list[str]:
    """Pids whose /proc/PID/<what> contains ``needle``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/{what}").read_bytes():
                    found.append(pid)
            except OSError:
                pass
    return found


async def test_empty_jit_config_fails_with_64(
    tmp_path: Path, images: Images, runtime: ProcessRuntime
) -> None:
    req = _req(tmp_path, "nojit", images.base, images.probe)
    await runtime.start(req, Secret(""))
    state = await _wait_for(runtime, req)
    assert state.exit_code == 64
    assert "IMP_GITHUB_JITCONFIG is empty" in state.log_tail
    await runtime.cleanup(req)


def test_wrapper_script_contract(tmp_path: Path) -> None:
    """The wrapper on the host's sh: refuses an empty value; never runs config.sh."""
    wrapper = resources.files("impvm.agent").joinpath("assets/runner")
    script = tmp_path / "runner"
    script.write_bytes(wrapper.read_bytes())
    res = subprocess.run(["sh", str(script)], env={"PATH": "/usr/bin:/bin"}, capture_output=True)
    assert res.returncode == 64 and b"IMP_GITHUB_JITCONFIG" in res.stderr
    res = subprocess.run(
        ["sh", str(script)],
        env={"PATH": "/usr/bin:/bin", "IMP_GITHUB_JITCONFIG": "value-xyz"},
        capture_output=True,
    )
    assert res.returncode == 127 and b"value-xyz" not in res.stderr + res.stdout
    code = [ln for ln in script.read_text().splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "config.sh" in ln]
    assert [ln.strip() for ln in code if "exec " in ln] == ["exec ./run.sh"]
