"""The command lines :class:`~impvm.up.service.Service` starts the agent and the operator with,
from the configuration."""

from __future__ import annotations

from pathlib import Path

from impvm.up.config import UpConfig
from impvm.up.manifests import SYSTEM_NAMESPACE


def agent_args(
    config: UpConfig, data_dir: Path, node: str, *, own_node: bool, token_file: Path
) -> list[str]:
    """``impvm agent``'s arguments for ``node`` (``own_node``: the configured node; another
    node's agent gets a metrics port of its own), its hand-out token in ``token_file``."""
    a = config.agent
    args = [
        "agent",
        "--node-name",
        node,
        "--runtime",
        a.runtime,
        "--workdir",
        str(data_dir / f"agent-{node}"),
        "--image-cache-mib",
        str(a.image_cache_mib),
        "--lease-namespace",
        SYSTEM_NAMESPACE,
        "--qemu-accelerator",
        a.qemu_accelerator,
    ]
    if a.vcpu:
        args += ["--vcpu", str(a.vcpu)]
    if a.memory_mib:
        args += ["--memory-mib", str(a.memory_mib)]
    if a.qemu_kernel:
        args += ["--qemu-kernel", str(a.qemu_kernel)]
    if a.cosign:
        args += ["--cosign", str(a.cosign)]
    for r in a.insecure_registries:
        args += ["--insecure-registry", r]
    for p in a.read_only_binds:
        args += ["--bind-ro", str(p)]
    args += [
        "--guest-network",
        a.guest_network,
        "--guest-subnet",
        a.guest_subnet,
        "--network-table",
        a.network_table,
        "--network-prefix",
        a.network_prefix,
        "--metrics-address",
        # another node's agent on this machine (tests): a free port of its own
        a.metrics_listen if own_node else a.metrics_listen.rpartition(":")[0] + ":0",
    ]
    for d in a.guest_dns or []:
        args += ["--guest-dns", d]
    host, port = config.listen()
    url = f"http://{_near(host)}:{port}"
    args += ["--operator-url", url, "--token-file", str(token_file)]
    return args


def operator_args(config: UpConfig, host: str, port: int) -> list[str]:
    """``impvm operator``'s arguments, listening on ``host``:``port``."""
    args = [
        "operator",
        "--http-host",
        host,
        "--http-port",
        str(port),
        *config.operator.options(),
        "--advertise-url",
        f"http://{_near(host)}:{port}",
    ]
    if config.github.api_url:
        args += ["--github-api-url", config.github.api_url]
    return args


def _near(host: str) -> str:
    """How a process on this machine reaches a server listening on ``host`` (URL form)."""
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - the address it listens on, not ours
        host = "127.0.0.1"
    return f"[{host}]" if ":" in host else host
