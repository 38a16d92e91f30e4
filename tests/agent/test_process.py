"""What only the ``process`` runtime does (the shared Runtime contract is tests/runtime): the JIT
config travels in the bubblewrap sandbox's environment, and the runner wrapper's own contract."""

from __future__ import annotations

import secrets
import subprocess
from importlib import resources
from pathlib import Path

from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.agent.runtime import Secret
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
