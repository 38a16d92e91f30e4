"""README.md's "Run on your cluster" and "Run on one machine" sections, run as far as this
machine allows: their shell blocks and files, taken from the README itself.

What differs from a real install, and why: the cluster is the test control plane (a real
kube-apiserver without kubelets, so the chart's pods are never scheduled, and a Node object
stands in for the KVM host); GitHub is the stand-in, seeded with the App and installation ids the
README shows; the one-machine configuration gets the stand-in's URL, the test images and the
process runtime on the host's network (QEMU boots and VM networks are covered by tests/qemu and
tests/network; the stand-in listens on loopback), a free port and throwaway etcd data; paths
under /etc, /var/lib and /opt move into a temporary directory and the checkout, ``sudo`` is
dropped (the tests run as root), and ``systemctl`` (no systemd here) becomes ``systemd-analyze
verify`` of the installed unit.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient, Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import DaemonSet, Deployment
from lightkube.resources.core_v1 import Node, Secret

from impvm.agent.process import host_python_binds
from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.seed import make_private_key, seed_github
from impvm.devstack.standin import StandIn
from impvm.devstack.testimages import build_test_images
from impvm.kube.controlplane import ControlPlane, free_port
from tests.conftest import REPO

pytestmark = [pytest.mark.controlplane]

README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The text of the ``## title`` section."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block."""
    return re.findall(r"^```(\w+)\n(.*?)^```", text, re.M | re.S)


def override(script: str, values: dict[str, str]) -> str:
    """Replace the README's ``NAME=value`` assignments by the test's values."""
    for name, value in values.items():
        script, n = re.subn(rf"^{name}=.*$", f"{name}={value}", script, flags=re.M)
        assert n == 1, f"README does not set {name}"
    return script


def bash(script: str, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"README commands failed:\n{script}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def test_run_on_your_cluster(
    tmp_path: Path, control_plane: ControlPlane, kube: Client, helm: Any
) -> None:
    text = section("Run on your cluster")
    sh = [b for lang, b in blocks(text) if lang == "sh"]
    files = [b for lang, b in blocks(text) if lang == "yaml"]
    assert len(sh) == 3 and len(files) == 1
    (tmp_path / "charts").symlink_to(REPO / "charts")
    for body in files:
        name = body.splitlines()[0].removeprefix("# ").strip()
        (tmp_path / name).write_text(body)
    key = tmp_path / "app.pem"
    key.write_text(make_private_key())
    digest_op, digest_ag = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    node = f"readme-{secrets.token_hex(3)}"
    hook = secrets.token_hex(16)
    script = "\n".join(
        [
            override(
                sh[0],
                {
                    "OPERATOR_DIGEST": digest_op,
                    "AGENT_DIGEST": digest_ag,
                    "REGISTRY": "registry.example.com/impvm",
                    "NODES": node,
                    "APP_ID": "4242",
                    "INSTALLATION_ID": "777",
                    "PRIVATE_KEY": str(key),
                    "WEBHOOK_SECRET": hook,
                },
            ),
            *sh[1:],
        ]
    )
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "helm").symlink_to(helm.path)
    (bindir / "kubectl").symlink_to(control_plane.kubectl)
    env = {
        **os.environ,
        "KUBECONFIG": str(control_plane.kubeconfig),
        "PATH": f"{bindir}:{os.environ['PATH']}",
    }
    kube.create(Node(metadata=ObjectMeta(name=node)))
    try:
        out = bash(script, tmp_path, env)
        # helm printed the chart's next steps; the pool was accepted and is listed
        assert "impvm-operator" in out and "kubectl label node NODE imp.dev/agent=true" in out
        assert "ci-pool" in out
        got = kube.get(Node, node)
        assert got.metadata and got.metadata.labels and got.metadata.labels["imp.dev/agent"]
        sec = kube.get(Secret, "github-runner-app", namespace="default")
        assert sorted(sec.data or {}) == [
            "github_app_id",
            "github_app_installation_id",
            "github_app_private_key",
        ]
        dep = kube.get(Deployment, "impvm-operator", namespace="impvm-system")
        assert dep.spec is not None and dep.spec.template.spec is not None
        assert dep.spec.template.spec.containers[0].image == (
            f"registry.example.com/impvm/impvm@{digest_op}"
        )
        ds = kube.get(DaemonSet, "impvm-agent", namespace="impvm-system")
        assert ds.spec is not None and ds.spec.template.spec is not None
        assert ds.spec.template.spec.containers[0].image.endswith(digest_ag)
        pool = kube.get(ImpVMRunnerPoolResource, "ci-pool", namespace="default")
        assert pool.spec["scaling"]["mode"] == "hybrid"
    finally:
        for cmd in (
            "helm uninstall impvm --namespace impvm-system --wait=false",
            "kubectl delete --ignore-not-found -f pool.yaml",
            "kubectl -n default delete --ignore-not-found secret github-runner-app github-webhook",
            f"kubectl delete --ignore-not-found node {node}",
        ):
            subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True)


def rewrite(text: str, root: Path) -> str:
    """Move the README's system paths into ``root`` and the checkout; drop sudo."""
    text = re.sub(r"\bsudo ", "", text)
    text = text.replace("/opt/impvm", str(REPO))
    for p in ("/etc/impvm", "/var/lib/impvm", "/etc/systemd/system"):
        text = text.replace(p, f"{root}{p}")
    return text


def write_config(path: Path, cfg: dict[str, Any]) -> str:
    """Write the configuration; return the webhook secret the README's commands made."""
    path.write_text(yaml.safe_dump(cfg))
    return (path.parent / "webhook-secret").read_text().strip()


def start(cmd: str, out: Path) -> subprocess.Popen[bytes]:
    with out.open("wb") as f:
        return subprocess.Popen(cmd.split(), stdout=f, stderr=subprocess.STDOUT)


def verify_unit(unit: Path) -> None:
    check = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stderr


async def test_run_on_one_machine(tmp_path: Path) -> None:
    text = section("Run on one machine")
    all_blocks = blocks(text)
    sh = [rewrite(b, tmp_path) for lang, b in all_blocks if lang == "sh"]
    (config_block,) = [b for lang, b in all_blocks if lang == "yaml"]
    assert len(sh) == 3
    setup, up, service = sh
    cfg: dict[str, Any] = yaml.safe_load(rewrite(config_block, tmp_path))
    config_path = Path(rewrite(config_block.splitlines()[0].removeprefix("# "), tmp_path))

    key = make_private_key()
    (tmp_path / "my-app.private-key.pem").write_text(key)
    standin = StandIn()
    await standin.start()
    app_id, installation = cfg["github"]["app"]["id"], cfg["github"]["app"]["installationId"]
    org = cfg["pools"]["ci-pool"]["platform"]["scope"]["org"]
    seed_github(standin, key, app_id=app_id, installation_id=installation, org=org)
    st = standin.state
    registry = LocalRegistry(storage_dir=tmp_path / "registry")
    await registry.start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        images = await build_test_images(tmp_path / "images", registry.address)
        bash(setup, tmp_path, dict(os.environ))
        assert (config_path.parent / "app.pem").stat().st_mode & 0o777 == 0o600
        assert (config_path.parent / "webhook-secret").stat().st_mode & 0o777 == 0o600

        # this machine's GitHub, images, runtime and port (see the module docstring)
        cfg["github"]["apiURL"] = standin.url
        port = free_port()
        cfg["operator"]["listen"] = f"127.0.0.1:{port}"
        cfg["agent"].update(
            runtime="process",
            guestNetwork="unisolated",
            insecureRegistries=[registry.address],
            readOnlyBinds=[str(p) for p in host_python_binds()],
        )
        cfg["kubernetes"] = {"apiPort": 0, "etcdFsync": False}
        tmpl = cfg["templates"]["gh-runner"]
        tmpl.update(image=images.base, runnerLayer=images.runner_layer)
        hook = write_config(config_path, cfg)
        standin.add_webhook(f"http://127.0.0.1:{port}/webhooks/github", hook)

        (cmd,) = up.strip().splitlines()
        assert cmd.endswith(f"impvm up --config {config_path}"), cmd
        proc = start(cmd, tmp_path / "impvm-up.out")
        kubeconfig = Path(cfg["dataDir"]) / "controlplane" / "kubeconfig"
        deadline = time.monotonic() + 180
        idle = False
        while not idle:
            assert proc.poll() is None, (tmp_path / "impvm-up.out").read_text()
            assert time.monotonic() < deadline, (tmp_path / "impvm-up.out").read_text()
            await asyncio.sleep(1)
            runners = list(st.runners.values())
            if not kubeconfig.exists() or len(runners) != 1 or runners[0].status != "online":
                continue
            async with AsyncClient(config=KubeConfig.from_file(str(kubeconfig))) as k:
                pool = await k.get(ImpVMRunnerPoolResource, "ci-pool", namespace="default")
                idle = (pool.to_dict().get("status") or {}).get("idle") == 1
        # the idle runner registered with the pool's labels through the README's App
        (runner,) = st.runners.values()
        assert "imp" in runner.labels
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=90) == 0, (tmp_path / "impvm-up.out").read_text()

        # the systemd unit: installed as shown, then checked (no systemd to start it here)
        unit = tmp_path / "etc/systemd/system/impvm.service"
        unit.parent.mkdir(parents=True)
        lines = service.strip().splitlines()
        assert lines[0].startswith("cp ") and all("systemctl" in x for x in lines[1:])
        bash(lines[0], tmp_path, dict(os.environ))
        unit.write_text(rewrite(unit.read_text(), tmp_path))
        verify_unit(unit)
        assert f"ExecStart={sys.prefix}/bin/impvm up --config" in unit.read_text().replace(
            str(REPO / ".venv"), sys.prefix
        )
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        await registry.stop()
        await standin.stop()
