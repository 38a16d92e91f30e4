"""``impvm up`` survives ``kill -9`` of its whole process tree: started on a data directory, a
burst of jobs queued, every process (control plane, operator, agent, the runners' sandboxes)
SIGKILLed mid-burst, started again on the same directory: the same pool carries on, every job
runs, no registration is left behind and no secret shows up in a log or an object.

GitHub (the stand-in) and the registry run in this test process: they are what survives a crash
of the machine's service. The agent uses the process runtime (bubblewrap) to keep the test at a
couple of minutes; the qemu runtime goes through the same agent code (tests/qemu).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.core_v1 import Event, Secret

from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.devconfig import dev_config
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.seed import (
    NAMESPACE,
    POOL,
    REPO,
    make_private_key,
    random_webhook_secret,
    seed_github,
)
from impvm.devstack.standin import StandIn
from impvm.devstack.testimages import build_test_images
from impvm.kube.controlplane import free_port

pytestmark = [pytest.mark.controlplane]

JOBS = 8
MAX_CONCURRENT = 3


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def gone(pids: list[int], seconds: float = 30.0) -> bool:
    """Whether every pid is gone (or a zombie) within ``seconds``."""
    for _ in range(int(seconds / 0.2)):
        if not any(alive(p) for p in pids):
            return True
        await asyncio.sleep(0.2)
    return False


def kill_tree(proc: subprocess.Popen[bytes]) -> list[int]:
    """SIGSTOP then SIGKILL ``proc`` and everything below it, as a power cut would; returns the
    pids."""
    pids = [proc.pid, *descendants(proc.pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGSTOP)
    pids = sorted(set(pids) | set(descendants(proc.pid)))
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    proc.wait(timeout=30)
    return pids


@dataclass
class Machine:
    """What outlives the service: GitHub (stand-in), the registry, the data directory."""

    tmp: Path
    standin: StandIn
    config: Path
    data: Path
    private_key: str
    webhook_secret: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    kube: AsyncClient | None = None
    jit_configs: set[str] = field(default_factory=set)

    def start(self) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"impvm-up-{len(self.procs)}.out", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "impvm.cli", "up", "--config", str(self.config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.procs.append(proc)
        return proc

    def output(self) -> str:
        return "".join(p.read_text() for p in sorted(self.tmp.glob("impvm-up-*.out")))

    async def client(self) -> AsyncClient:
        if self.kube is None:
            kubeconfig = self.data / "controlplane" / "kubeconfig"
            if not kubeconfig.exists():
                raise FileNotFoundError(kubeconfig)  # not yet: until() asks again
            self.kube = AsyncClient(config=KubeConfig.from_file(str(kubeconfig)))
        return self.kube

    async def pool(self) -> dict[str, Any]:
        obj = await (await self.client()).get(ImpVMRunnerPoolResource, POOL, namespace=NAMESPACE)
        return obj.to_dict()

    async def vms(self) -> list[dict[str, Any]]:
        kube = await self.client()
        return [o.to_dict() async for o in kube.list(ImpVMResource, namespace=NAMESPACE)]

    async def sample(self) -> None:
        """Record every JIT config the API server holds (to search for them elsewhere)."""
        kube = await self.client()
        async for sec in kube.list(Secret, namespace=NAMESPACE):
            if sec.data and "jitconfig" in sec.data:
                self.jit_configs.add(base64.b64decode(sec.data["jitconfig"]).decode())


async def until(
    what: str, check: Callable[[], Awaitable[bool]], seconds: float, m: Machine
) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            await m.sample()
            if await check():
                return
        except Exception:  # the API server restarting: ask again
            pass
        for p in m.procs[-1:]:
            assert p.poll() is None, f"impvm up exited with {p.returncode}:\n{m.output()[-3000:]}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {seconds:.0f}s:\n{m.output()[-2000:]}")
        await asyncio.sleep(0.5)


@pytest.fixture
async def machine(tmp_path: Path) -> AsyncIterator[Machine]:
    standin = StandIn()
    await standin.start()
    standin.state.runner_timeout = 5.0  # GitHub notices a dead runner after a while; here sooner
    pem = make_private_key()
    seed_github(standin, pem)
    registry = LocalRegistry(storage_dir=tmp_path / "registry")
    await registry.start()
    m: Machine | None = None
    try:
        images = await build_test_images(tmp_path / "images", registry.address)
        secrets = tmp_path / "etc"
        secrets.mkdir(mode=0o700)
        key_file = secrets / "app.pem"
        key_file.write_text(pem)
        key_file.chmod(0o600)
        hook = random_webhook_secret()
        hook_file = secrets / "webhook-secret"
        hook_file.write_text(hook + "\n")
        hook_file.chmod(0o600)
        port = free_port()
        data = tmp_path / "data"
        cfg = dev_config(
            workdir=data,
            standin_url=standin.url,
            key_file=key_file,
            registry=registry.address,
            images=images,
            operator_port=port,
            scaling_mode="hybrid",
            polling_interval_seconds=5,
            webhook_secret_file=hook_file,
        )
        scaling = cfg["pools"][POOL]["scaling"]
        scaling.update(maxConcurrent=MAX_CONCURRENT, scaleUpStep=MAX_CONCURRENT, cooldownSeconds=5)
        config = tmp_path / "impvm.yaml"
        config.write_text(yaml.safe_dump(cfg))
        standin.add_webhook(f"http://127.0.0.1:{port}/webhooks/github", hook)
        m = Machine(tmp_path, standin, config, data, pem, hook)
        yield m
    finally:
        if m is not None:
            if m.kube is not None:
                await m.kube.close()
            for p in m.procs:
                if p.poll() is None:
                    kill_tree(p)
        await registry.stop()
        await standin.stop()


async def test_kill_9_of_everything_mid_burst_loses_no_job_and_leaks_nothing(
    machine: Machine,
) -> None:
    m = machine
    first = m.start()

    async def one_idle() -> bool:
        st = (await m.pool()).get("status") or {}
        return st.get("idle") == 1 and len(m.standin.state.runners) == 1

    await until("the pool's idle runner", one_idle, 180, m)
    pool_uid = (await m.pool())["metadata"]["uid"]
    ca = (m.data / "controlplane" / "pki" / "ca.crt").read_bytes()
    ports = (m.data / "controlplane" / "ports.json").read_text()

    ids = [
        m.standin.queue_job(REPO, ["self-hosted", "imp"], name=f"job-{i}", sleep_seconds=3.0).id
        for i in range(JOBS)
    ]

    def jobs() -> list[Any]:
        return [m.standin.state.jobs[i] for i in ids]

    async def mid_burst() -> bool:
        states = [j.status for j in jobs()]
        return states.count("completed") >= 1 and "queued" in states

    await until("the burst under way", mid_burst, 180, m)
    at_kill = {j.id: j.status for j in jobs()}
    pids = kill_tree(first)
    assert len(pids) >= 6, pids  # impvm up, etcd, kube-apiserver, kcm, operator, agent, ...
    assert await gone(pids), "a process of the killed tree survived"
    if m.kube is not None:
        await m.kube.close()
        m.kube = None

    second = m.start()

    async def all_done() -> bool:
        return all(j.status == "completed" for j in jobs())

    await until(f"{JOBS} jobs completed", all_done, 300, m)

    async def settled() -> bool:
        st = (await m.pool()).get("status") or {}
        vms = {v["metadata"]["name"] for v in await m.vms()}
        runners = {r.name for r in m.standin.state.runners.values()}
        return st.get("idle") == 1 and st.get("total") == 1 and runners == vms and len(vms) == 1

    await until("the pool back at minIdle, one registration per VM", settled, 180, m)

    # the same pool, certificates and ports carried on
    assert (await m.pool())["metadata"]["uid"] == pool_uid
    assert (m.data / "controlplane" / "pki" / "ca.crt").read_bytes() == ca
    assert (m.data / "controlplane" / "ports.json").read_text() == ports

    # every job ran on a runner of its own; those still queued at the kill succeeded, those in
    # flight failed only as GitHub fails the job of a runner that died (or had just finished)
    done = jobs()
    assert len({j.runner_name for j in done}) == JOBS
    assert all(j.runner_name and j.runner_name.startswith(POOL + "-") for j in done)
    for j in done:
        if at_kill[j.id] == "queued":
            assert j.conclusion == "success", (j.id, j.conclusion)
        elif at_kill[j.id] == "completed":
            assert j.conclusion == "success", (j.id, j.conclusion)
        else:
            assert j.conclusion in ("success", "failure"), (j.id, j.conclusion)
    assert any(s == "queued" for s in at_kill.values())

    # stop it the way systemd does: SIGTERM, exit 0, nothing left behind
    tree = [second.pid, *descendants(second.pid)]
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=90) == 0, m.output()[-3000:]
    assert await gone(tree), "a process outlived the stop"

    # no secret in any log or in the output; the JIT configs only ever in their Secrets
    assert m.jit_configs
    secrets = {
        "private key": m.private_key.strip().splitlines()[1],
        "webhook secret": m.webhook_secret,
        **{f"jit {i}": j for i, j in enumerate(m.jit_configs)},
    }
    texts = {str(p): p.read_text(errors="replace") for p in m.data.rglob("*.log")}
    texts["impvm up output"] = m.output()
    for where, text in texts.items():
        for what, value in secrets.items():
            assert value not in text, f"{what} in {where}"


def component_pid(proc: subprocess.Popen[bytes], name: str) -> int | None:
    """The pid of ``impvm <name>`` below ``proc``."""
    for p in descendants(proc.pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            if b"impvm.cli" in argv and argv[argv.index(b"impvm.cli") + 1] == name.encode():
                return p
    return None


async def test_a_dead_component_is_restarted_and_objects_hold_no_secret(
    machine: Machine,
) -> None:
    """A component killed under a running service is started again; stopped with SIGTERM and
    started again, VMs, pools and Events never carry the JIT config or the key, and the App
    Secret is the key file's content."""
    m = machine
    proc = m.start()

    async def idle() -> bool:
        st = (await m.pool()).get("status") or {}
        return st.get("idle") == 1

    await until("an idle runner", idle, 180, m)
    old = component_pid(proc, "operator")
    assert old is not None
    os.kill(old, signal.SIGKILL)

    async def restarted() -> bool:
        new = component_pid(proc, "operator")
        return new is not None and new != old and "operator restarted" in m.output()

    await until("the operator restarted", restarted, 30, m)
    assert "operator exited with -9; restarting in 1s" in m.output()
    before = {v["metadata"]["name"] for v in await m.vms()}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0, m.output()[-2000:]
    if m.kube is not None:
        await m.kube.close()
        m.kube = None
    m.start()

    async def replaced() -> bool:
        # the VM whose sandbox stopped with the service is replaced by a new idle one
        names = {v["metadata"]["name"] for v in await m.vms()}
        return await idle() and len(names) == 1 and not names & before

    await until("a new idle runner", replaced, 180, m)
    kube = await m.client()
    app = await kube.get(Secret, "github-runner-app", namespace=NAMESPACE)
    assert app.data is not None
    assert base64.b64decode(app.data["github_app_private_key"]).decode() == m.private_key
    dumps = [yaml.safe_dump(v) for v in await m.vms()]
    dumps.append(yaml.safe_dump(await m.pool()))
    dumps += [yaml.safe_dump(e.to_dict()) async for e in kube.list(Event, namespace="*")]
    body = m.private_key.strip().splitlines()[1]
    for d in dumps:
        assert body not in d
        for j in m.jit_configs:
            assert j not in d
