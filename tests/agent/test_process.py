"""What only the ``process`` runtime does (the shared Runtime contract is tests/runtime): the JIT
config travels in the bubblewrap sandbox's environment, the runner wrapper's own contract, and the
host's Python shared with a sandbox without what sits beside it."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime, host_python_binds
from impvm.agent.runtime import Secret
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.testimages import build_runner_layer_image
from tests.runtime_fixtures import Images, procs_with, vm_request, wait_for


async def test_jit_config_is_delivered_in_the_sandbox_environment(
    tmp_path: Path, images: Images, shared_store: ImageStore
) -> None:
    """bwrap gets it through its environment (never ``--setenv``, which would put it on a
    command line): it is in the sandbox's environment, which also proves that the contract
    suite's command-line scan looks at the right processes."""
    rt = ProcessRuntime(shared_store)
    marker = "jitmarker-" + secrets.token_hex(16)
    req = vm_request(tmp_path, "jit-env", images.base, images.sleep, memory_mib=256)
    await rt.start(req, Secret(marker))
    await wait_for(rt, req, "ready", 30)
    assert procs_with(marker.encode(), "environ") != []
    assert procs_with(marker.encode(), "cmdline") == []
    await rt.cleanup(req)
    assert procs_with(marker.encode(), "environ") == []


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


async def test_a_secret_beside_the_script_that_started_the_stack_is_never_shared(
    tmp_path: Path,
    images: Images,
    registry: LocalRegistry,
    shared_store: ImageStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``python deploy/run.py`` puts ``deploy/`` first on ``sys.path``; an App key there (or in
    the working directory, or any other ``sys.path`` entry) was bound into every sandbox with
    the host's Python. Now a job cannot read it, and the stand-in runner's Python still works."""
    deploy = Path("/var/tmp") / f"impvm-deploy-{secrets.token_hex(6)}"  # not below /tmp: the
    deploy.mkdir()  # sandbox's /tmp is its own scratch, that would hide it anyway
    try:
        key = deploy / "app-key.pem"
        key.write_text("-----BEGIN PRIVATE KEY-----\nsecret-" + secrets.token_hex(8) + "\n")
        (deploy / "helpers").mkdir()
        monkeypatch.syspath_prepend(str(deploy))
        monkeypatch.syspath_prepend(str(deploy / "helpers"))
        monkeypatch.chdir(deploy)
        binds = host_python_binds()
        assert not [b for b in binds if b.is_relative_to(deploy) or deploy.is_relative_to(b)]
        run_sh = (
            "#!/bin/sh\n"
            f"cat {key} 2>/dev/null || echo key-unreadable\n"
            f"ls {deploy} 2>/dev/null | grep -q . && echo dir-listed || echo dir-absent\n"
            f'{sys.executable} -c "import httpx, impvm.devstack.standin_runner; print(1 + 1)"\n'
        )
        layer = await build_runner_layer_image(
            tmp_path / "layer", registry.address, run_sh=run_sh, tag="secret-beside"
        )
        rt = ProcessRuntime(shared_store, extra_ro_binds=binds)
        req = vm_request(tmp_path, "beside", images.base, layer, memory_mib=256)
        await rt.start(req, Secret("jit-beside"))
        state = await wait_for(rt, req, None, 60)
        await rt.cleanup(req)
        assert "key-unreadable" in state.log_tail and "dir-absent" in state.log_tail, state
        assert "secret-" not in state.log_tail
        assert state.log_tail.splitlines()[-1] == "2", state.log_tail  # its Python runs
    finally:
        shutil.rmtree(deploy, ignore_errors=True)
