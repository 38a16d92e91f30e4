"""The built runner images in a real VM: the qemu runtime pulls ``runner-base`` and
``runner-layer`` (stand-in runner) by digest from a loopback registry, boots them, and the
runner, started by the wrapper ``/usr/local/bin/runner``, takes a job from the GitHub stand-in and
runs it in the image's Debian userland."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from impvm.agent.images import ImageStore
from impvm.agent.process import host_python_binds
from impvm.agent.qemu import create_qemu_runtime
from impvm.agent.runtime import Secret, VMRequest
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.standin import StandIn
from impvm.devstack.standin.records import RunnerRec

# What a job sees: the image's own Debian 12 and tools (not the host's: no host library directory
# is shared, only the stand-in runner's interpreter and the impvm sources).
JOB = r"""set -eu
. /etc/os-release
echo "job-os=$ID-$VERSION_ID-$VERSION_CODENAME"
echo "job-git=$(git --version)"
echo "job-jq=$(echo '{"a":[1,2]}' | jq -c '.a')"
echo "job-curl=$(curl --version | head -n1 | cut -d' ' -f1-2)"
echo "job-unzip=$(unzip -v | head -n1 | cut -d' ' -f1-2)"
echo "job-runner=$(id runner)"
echo "job-icu=$(ls /usr/lib/x86_64-linux-gnu/libicuuc.so.72 >/dev/null && echo yes)"
echo "job-ca=$(test -s /etc/ssl/certs/ca-certificates.crt && echo yes)"
echo "job-jit=${ACTIONS_RUNNER_INPUT_JITCONFIG:-absent}"
echo "job-wrapper=$(head -n2 /usr/local/bin/runner | tail -n1 | cut -c1-30)"
echo "job-layer=$(ls /home/runner/actions-runner)"
"""


def _system_lib(p: Path) -> bool:
    return any(
        str(p) == d or str(p).startswith(d + "/")
        for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64")
    )


@pytest.mark.timeout(900)
async def test_runner_images_boot_in_qemu_and_run_a_job(
    tmp_path: Path, pushed: dict[str, str], image_registry: LocalRegistry
) -> None:
    binds = [p for p in host_python_binds() if not _system_lib(p)]
    store = ImageStore(tmp_path / "cache", 4 << 30, {image_registry.address})
    rt = await create_qemu_runtime(store, tmp_path / "state", extra_ro_binds=binds)
    standin = StandIn()
    await standin.start()
    try:
        st = standin.state
        st.base_url = f"http://10.0.2.2:{standin.port}"  # the host as the guest sees it
        st.add_org("my-org")
        st.add_repo("my-org/app")
        runner = RunnerRec(
            id=st.next_id(),
            name="debian-vm",
            labels=["self-hosted", "imp"],
            group_id=1,
            org="my-org",
            repo=None,
            session_token=st.new_secret("sess_"),
            work_folder="_work",
        )
        st.runners[runner.id] = runner
        job = st.queue_job("my-org/app", ["self-hosted", "imp"], command=["/bin/bash", "-c", JOB])
        req = VMRequest(
            vm_id="test.debian-vm.0000",
            name="debian-vm",
            namespace="test",
            image=pushed["runner-base"],
            runner_layer=pushed["runner-layer"],
            allow_unpinned_images=False,
            vcpu=1,
            memory_mib=1024,
            disk_gib=2,
            workdir=tmp_path / "vms" / "debian-vm",
        )
        jit = st.jit_config(runner)
        await rt.start(req, Secret(jit))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 600
        while (state := await rt.inspect(req)).status != "exited":
            assert loop.time() < deadline, f"VM did not finish: {state}"
            await asyncio.sleep(0.5)
        log = (req.workdir / "console.log").read_text(errors="replace")
        await rt.cleanup(req)
    finally:
        await standin.stop()
    out = dict(
        line.strip().split("=", 1) for line in log.splitlines() if line.strip().startswith("job-")
    )
    assert state.exit_code == 0, log[-3000:]
    assert f"standin-runner: debian-vm job {job.id} success" in log
    assert st.jobs[job.id].status == "completed" and st.jobs[job.id].conclusion == "success"
    assert out["job-os"] == "debian-12-bookworm", out
    assert out["job-git"].startswith("git version 2.")
    assert out["job-jq"] == "[1,2]"
    assert out["job-curl"].startswith("curl 7.")
    assert out["job-unzip"].startswith("UnZip 6")
    assert out["job-runner"].startswith("uid=10001(runner) gid=10001(runner)")
    assert out["job-icu"] == "yes" and out["job-ca"] == "yes"
    assert out["job-jit"] == "absent"  # job steps never see the runner's credentials
    assert out["job-layer"] == "run.sh"
    assert out["job-wrapper"].startswith("# /usr/local/bin/runner")
    assert jit not in log
    assert not await asyncio.to_thread(os.path.exists, req.workdir)
