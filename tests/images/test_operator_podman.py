"""The built ``impvm`` image runs the operator under podman (Debian's, rootful) against the test
control plane, the way a Deployment runs it: read-only root filesystem, the image's non-root
user, and the operator ServiceAccount's token (``deploy/rbac/operator.yaml``, TokenRequest) in
a kubeconfig mounted read-only. It reconciles the seed's minimal example (images: the built runner images, by digest): the pool's
ImpVM and the JIT Secret owned by it appear. No image hub: podman's storage is filled from the
build's OCI layout with skopeo. The ``impvm-agent`` image is checked for the tools the agent
runs and the guest kernel it boots.

Podman here: host network (the API server and the GitHub stand-in listen on loopback), runc (crun
refuses this host's hybrid cgroup layout), ``vfs`` storage in a private directory, and
file-descriptor/process limits below the host's (the sandbox lacks CAP_SYS_RESOURCE, so podman's
default of raising them fails)."""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

import pytest
import yaml
from lightkube.codecs import load_all_yaml
from lightkube.resources.core_v1 import Secret

from impvm.api.resources import ImpVMResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE, POOL
from impvm.devstack.stack import Stack, wait_for
from impvm.images.options import BuiltImage

pytestmark = [pytest.mark.controlplane]

SEED_EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "minimal-example.yaml"


def podman(d: Path) -> list[str]:
    """The podman command with its storage in ``d`` (see the module docstring)."""
    return [
        "podman",
        "--root",
        str(d / "storage"),
        "--runroot",
        str(d / "run"),
        "--tmpdir",
        str(d / "tmp"),
        "--storage-driver",
        "vfs",
        "--cgroup-manager",
        "cgroupfs",
        "--events-backend",
        "file",
        "--runtime",
        "runc",
    ]


# podman's defaults raise these limits, which this sandbox does not allow
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def load(d: Path, image: BuiltImage) -> str:
    """Copy a built image from its OCI layout into the storage in ``d``; returns its name."""
    name = f"localhost/imp/{image.name}:{image.tag}"
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            image.oci_ref,
            f"containers-storage:[vfs@{d / 'storage'}+{d / 'run'}]{name}",
        ],
        check=True,
    )
    return name


def short_dir() -> Path:
    """A private directory with a short path (podman wants a run root of at most 50 chars)."""
    return Path(tempfile.mkdtemp(prefix="impvm-podman-"))


def remove_storage(d: Path) -> None:
    subprocess.run([*podman(d), "rmi", "--all", "--force"], capture_output=True, check=False)
    shutil.rmtree(d, ignore_errors=True)


class PodmanOperatorStack(Stack):
    """The embedded stack with the operator in the ``impvm`` image under podman (no agent)."""

    image: BuiltImage
    image_name: str
    podman_dir: Path
    container: str

    def podman(self) -> list[str]:
        return podman(self.podman_dir)

    async def start(self) -> PodmanOperatorStack:
        # the service starts "the operator" through this stack's podman container, not a process
        service = await self.start_fixtures()
        service.start_operator = self.start_operator  # type: ignore[method-assign]
        await service.start(start_agent=False)
        await self.after_start()
        return self

    def start_operator(self) -> None:
        assert self.standin is not None and self.control_plane is not None
        if not self.operator_http_port:
            from impvm.kube.controlplane import free_port

            self.operator_http_port = free_port()
        # the operator's credentials and the cluster CA inlined in a kubeconfig;
        # kopf's in-cluster login would need the cluster DNS name kubernetes.default.svc:443
        cfg = yaml.safe_load(self.kubeconfigs["operator"].read_text())
        cluster = cfg["clusters"][0]["cluster"]
        ca = Path(cluster.pop("certificate-authority")).read_bytes()
        cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
        user = cfg["users"][0]["user"]
        for k in ("client-certificate", "client-key", "tokenFile"):
            if k in user:  # the container sees none of the host's files: inline them
                data = Path(user.pop(k)).read_bytes()
                if k == "tokenFile":
                    user["token"] = data.decode().strip()
                else:
                    user[f"{k}-data"] = base64.b64encode(data).decode()
        kubeconfig = self.podman_dir / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(cfg))
        kubeconfig.chmod(0o644)  # readable by the image's user; the directory is private
        self.container = f"impvm-operator-{uuid.uuid4().hex[:8]}"
        log: IO[bytes] = open(self.config.workdir / "operator.log", "ab")
        self.procs["operator"] = subprocess.Popen(
            [
                *self.podman(),
                "run",
                "--rm",
                "--name",
                self.container,
                "--network",
                "host",
                "--read-only",
                *LIMITS,
                "-e",
                "KUBECONFIG=/etc/impvm/kubeconfig",
                "-v",
                f"{kubeconfig}:/etc/impvm/kubeconfig:ro",
                self.image_name,
                "operator",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.operator_http_port),
                "--github-api-url",
                self.standin.url,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def remove_container(self) -> None:
        if hasattr(self, "container"):
            subprocess.run(
                [*self.podman(), "rm", "--force", "--time", "5", self.container],
                capture_output=True,
                check=False,
            )


@pytest.fixture
async def stack(
    tmp_path: Path, built: dict[str, BuiltImage], pushed: dict[str, str]
) -> AsyncIterator[PodmanOperatorStack]:
    s = PodmanOperatorStack(
        StackConfig(workdir=tmp_path / "stack", start_agent=False, apply_example=False)
    )
    s.image = built["impvm"]
    s.podman_dir = short_dir()
    s.image_name = await asyncio.to_thread(load, s.podman_dir, s.image)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()
        await asyncio.to_thread(s.remove_container)
        await asyncio.to_thread(remove_storage, s.podman_dir)


# the first test of a session on a machine without cached images builds them (minutes)
@pytest.mark.timeout(1800)
async def test_operator_image_reconciles_the_seed_example_under_podman(
    stack: PodmanOperatorStack, pushed: dict[str, str]
) -> None:
    assert stack.kube is not None
    # the seed's minimal example as committed, its two images replaced by the built ones
    docs = list(yaml.safe_load_all(SEED_EXAMPLE.read_text()))
    [template] = [d for d in docs if d["kind"] == "ImpVMTemplate"]
    template["spec"]["image"] = pushed["runner-base"]
    template["spec"]["runnerLayer"] = pushed["runner-layer"]
    for obj in load_all_yaml(yaml.safe_dump_all(docs)):
        await stack.kube.apply(obj, force=True)

    async def vm_with_secret() -> tuple[str, str] | None:
        assert stack.kube is not None
        async for vm in stack.kube.list(
            ImpVMResource, namespace=NAMESPACE, labels={"imp.dev/runner-pool": POOL}
        ):
            d = vm.to_dict()
            secret_name = d["spec"].get("runnerConfigSecret")
            if not secret_name:
                continue
            try:
                secret = await stack.kube.get(Secret, secret_name, namespace=NAMESPACE)
            except Exception:
                continue
            owners = secret.metadata.ownerReferences or []
            if any(o.uid == d["metadata"]["uid"] and o.controller for o in owners):
                jit = base64.b64decode((secret.data or {})["jitconfig"]).decode()
                return d["metadata"]["name"], jit
        return None

    name, jit = await wait_for("the pool's ImpVM and its JIT Secret", vm_with_secret, 300, stack)
    vm = (await stack.vms())[0]
    assert vm["spec"]["image"] == pushed["runner-base"]
    assert vm["spec"]["runnerLayer"] == pushed["runner-layer"]
    assert name == vm["metadata"]["name"]

    # it is the image's operator, as the image's non-root user, on a read-only root
    top = (
        await asyncio.to_thread(
            subprocess.run,
            [*stack.podman(), "exec", stack.container, "sh", "-c", "id -u; touch /x 2>&1 || true"],
            capture_output=True,
            text=True,
            check=True,
        )
    ).stdout.split("\n", 1)
    assert top[0] == "10000"
    assert "Read-only file system" in top[1]
    inspect = (
        await asyncio.to_thread(
            subprocess.run,
            [*stack.podman(), "inspect", "--format", "{{.ImageDigest}}", stack.container],
            capture_output=True,
            text=True,
            check=True,
        )
    ).stdout.strip()
    assert inspect == stack.image.digest
    await asyncio.sleep(1)
    logs = stack.logs()
    assert jit not in logs and stack.private_key_pem.splitlines()[1] not in logs


AGENT_CHECK = """set -eu
echo "uid=$(id -u)"
echo "qemu=$(qemu-system-x86_64 --version | head -n1)"
echo "skopeo=$(skopeo --version)"
echo "umoci=$(umoci --version)"
echo "bwrap=$(bwrap --version)"
echo "mkfs=$(mkfs.ext4 -V 2>&1 | head -n1)"
echo "nft=$(nft --version)"
echo "ip=$(ip -V)"
echo "busybox=$(busybox | head -n1 | cut -d' ' -f1-2)"
echo "initrd=$(ls /boot | grep -c initrd || true)"
echo "cosign=$(cosign version 2>&1 | grep '^GitVersion' | tr -s ' ' | cut -d' ' -f2)"
python -c 'from impvm.agent.qemu_guest import find_kernel, module_order
k = find_kernel(need_shares=False)
print("kernel=" + k.version, len(module_order(k)))'
impvm agent --help | grep -c -- --runtime | sed 's/^/help=/'
"""


@pytest.mark.timeout(1800)
async def test_agent_image_holds_the_runtime_tools_and_a_guest_kernel(
    built: dict[str, BuiltImage],
) -> None:
    d = short_dir()
    try:
        name = await asyncio.to_thread(load, d, built["impvm-agent"])
        proc = await asyncio.to_thread(
            subprocess.run,
            [
                *podman(d),
                "run",
                "--rm",
                "--network",
                "none",
                "--read-only",
                *LIMITS,
                "--entrypoint",
                "/bin/sh",
                name,
                "-c",
                AGENT_CHECK,
            ],
            capture_output=True,
            text=True,
        )
    finally:
        await asyncio.to_thread(remove_storage, d)
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert out["uid"] == "0"
    assert out["qemu"].startswith("QEMU emulator version 7.2")
    assert out["skopeo"].startswith("skopeo version 1.9")
    assert out["umoci"].startswith("umoci version 0.4")
    assert out["bwrap"].startswith("bubblewrap 0.8")
    assert out["mkfs"].startswith("mke2fs 1.47")
    # each VM's network: its nftables table and interfaces (the agent's preflight needs both)
    assert out["nft"].startswith("nftables v1.0")
    assert out["ip"].startswith("ip utility, iproute2-6")
    assert out["busybox"].startswith("BusyBox v1.35")
    assert out["initrd"] == "0"  # the agent builds its own guest initramfs
    assert out["cosign"] == "v2.6.5"  # templates with spec.verify work on the chart's agents
    version, modules = out["kernel"].split()
    assert version.endswith("-cloud-amd64") and int(modules) > 0
    assert out["help"] == "1"
