"""The configuration file of ``impvm up`` (``impvm.yaml``): a pydantic model; its loader
(:mod:`impvm.up.loader`) turns every problem into one :class:`ConfigError` naming the field.

Shape (camelCase keys, like the API; every key but ``github`` is optional)::

    dataDir: /var/lib/impvm            # control plane state (certificates, etcd), agent cache
    github:
      apiURL: https://api.github.com   # REST base URL (default github.com)
      app:
        id: 123456
        installationId: 7890123
        privateKeyFile: /etc/impvm/app.pem     # mode 0600 or stricter
      webhookSecretFile: /etc/impvm/webhook-secret   # for webhook/hybrid pools
    operator:
      listen: 0.0.0.0:8080             # POST /webhooks/github, GET /metrics, GET /healthz
    agent:
      runtime: qemu                    # qemu (default) or process (development)
      guestSubnet: 10.213.0.0/16       # each VM its own network (docs/network.md)
    kubernetes:
      apiPort: 6443                    # the embedded kube-apiserver, on 127.0.0.1
      namespace: default               # where the pools below and the credentials live
    classes:   {NAME: ImpVMClass spec}
    templates: {NAME: ImpVMTemplate spec}
    pools:     {NAME: ImpVMRunnerPool spec}   # platform.credentialsSecret and
                                              # scaling.webhook.secretRef may be left out

Specs are the API's own (:mod:`impvm.api.models`), so a pool here reads like one applied with
kubectl. Rules the API server checks beyond the models (its CEL rules) are checked by a
server-side dry run before anything runs (:mod:`impvm.up.apply`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from impvm.api.models import (
    NAME_PATTERN,
    ImpVMClassSpec,
    ImpVMRunnerPoolSpec,
    ImpVMTemplateSpec,
)
from impvm.scaling.settings import OperatorTunables

#: Secret the App credentials are written to (keys github_app_id, github_app_installation_id,
#: github_app_private_key), in ``kubernetes.namespace``; the name the runner-pool docs' minimal
#: example uses, so that example applies as it is
APP_SECRET = "github-runner-app"
#: Secret the webhook secret is written to (key webhook_secret)
WEBHOOK_SECRET = "github-webhook"


class ConfigError(Exception):
    """A configuration problem; ``str()`` is one line naming the file and the field."""


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, frozen=True, validate_default=True
    )


def _listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("want HOST:PORT, e.g. 0.0.0.0:8080")
    return value


class AppConfig(_Model):
    """The GitHub App the operator acts as (GitHub docs: "Authenticating as a GitHub App
    installation")."""

    id: int = Field(ge=1, description="App ID.")
    installation_id: int = Field(ge=1, alias="installationId", description="Installation ID.")
    private_key_file: Path = Field(
        alias="privateKeyFile", description="PEM private key; readable by its owner only."
    )


class GitHubConfig(_Model):
    """Where GitHub is and how impvm authenticates to it."""

    api_url: str | None = Field(
        default=None,
        alias="apiURL",
        pattern=r"^https?://\S+$",
        description="REST API base URL; default https://api.github.com.",
    )
    app: AppConfig
    webhook_secret_file: Path | None = Field(
        default=None,
        alias="webhookSecretFile",
        description="File holding the App's webhook secret (webhook and hybrid pools).",
    )


class OperatorConfig(OperatorTunables):
    """The operator process: where it listens, and its tunables (the fields and defaults of
    ``impvm operator``'s options, :class:`impvm.scaling.settings.OperatorTunables`)."""

    model_config = _Model.model_config

    listen: str = Field(
        default="0.0.0.0:8080",  # GitHub must reach the webhook receiver
        description="HOST:PORT of POST /webhooks/github, GET /metrics and GET /healthz.",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        return _listen(v)


class AgentConfig(_Model):
    """The one node agent."""

    runtime: Literal["qemu", "process"] = "qemu"
    node_name: str | None = Field(
        default=None, alias="nodeName", pattern=NAME_PATTERN, max_length=63
    )
    vcpu: int | None = Field(default=None, ge=1, description="vCPUs offered (default: all).")
    memory_mib: int | None = Field(default=None, ge=256, alias="memoryMiB")
    image_cache_mib: int = Field(default=10240, ge=64, alias="imageCacheMiB")
    insecure_registries: list[str] = Field(
        default_factory=list,
        alias="insecureRegistries",
        description="host:port registries pulled over plain HTTP (loopback development only).",
    )
    qemu_kernel: Path | None = Field(default=None, alias="qemuKernel")
    qemu_accelerator: Literal["auto", "kvm", "tcg"] = Field(default="auto", alias="qemuAccelerator")
    cosign: Path | None = Field(
        default=None,
        description="cosign binary verifying signed images (templates with spec.verify); "
        "default: cosign on PATH.",
    )
    read_only_binds: list[Path] = Field(
        default_factory=list,
        alias="readOnlyBinds",
        description="Host paths bound read-only into process-runtime sandboxes (development).",
    )
    guest_network: Literal["isolated", "unisolated"] = Field(
        default="isolated",
        alias="guestNetwork",
        description="isolated: each VM its own network, NAT and egress policy (docs/network.md); "
        "unisolated: VMs share this host's network and reach every service on it, no isolation "
        "at all (development only; warned about at start and in impvm status).",
    )
    guest_subnet: str = Field(
        default="10.213.0.0/16",
        alias="guestSubnet",
        description="IPv4 subnet the VMs' addresses come from (/16 to /28).",
    )
    guest_dns: list[str] | None = Field(
        default=None,
        alias="guestDns",
        description="Resolvers for VMs (default: the node's; [none]: none).",
    )
    network_table: str = Field(default="impvm", alias="networkTable", pattern=r"^[a-z][a-z0-9_-]*$")
    network_prefix: str = Field(
        default="impvm", alias="networkPrefix", pattern=r"^[a-z][a-z0-9]{0,8}$"
    )
    metrics_listen: str = Field(
        default="127.0.0.1:9464",
        alias="metricsListen",
        description="HOST:PORT of the agent's GET /metrics and GET /healthz.",
    )

    @field_validator("guest_network", mode="before")
    @classmethod
    def _renamed(cls, v: object) -> object:
        if v == "host":  # the old name: say what it became rather than only what is allowed
            raise ValueError("'host' was renamed 'unisolated' (it isolates nothing); want isolated")
        return v

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, v: str) -> str:
        return _listen(v)

    @field_validator("guest_dns")
    @classmethod
    def _dns(cls, v: list[str] | None) -> list[str] | None:
        import ipaddress

        if v is None or v == ["none"]:
            return v
        for d in v:
            ipaddress.IPv4Address(d)  # ValueError names the bad entry
        return v

    @field_validator("guest_subnet")
    @classmethod
    def _subnet(cls, v: str) -> str:
        import ipaddress

        net = ipaddress.IPv4Network(v)  # ValueError names what is wrong
        if not 16 <= net.prefixlen <= 28:
            raise ValueError("want a /16 to /28 IPv4 subnet")
        return v


class KubernetesConfig(_Model):
    """The embedded control plane."""

    api_port: int = Field(
        default=6443,
        ge=0,
        le=65535,
        alias="apiPort",
        description="kube-apiserver port on 127.0.0.1; 0: a free port, chosen once and kept.",
    )
    namespace: str = Field(default="default", pattern=NAME_PATTERN, max_length=63)
    etcd_fsync: bool = Field(
        default=True,
        alias="etcdFsync",
        description="fsync etcd's writes; false only for throwaway data (tests).",
    )


class UpConfig(_Model):
    """The whole file. Paths are absolute (the loader resolves them against the file's
    directory)."""

    data_dir: Path = Field(default=Path("/var/lib/impvm"), alias="dataDir")
    github: GitHubConfig
    operator: OperatorConfig = OperatorConfig()
    agent: AgentConfig = AgentConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    classes: dict[str, ImpVMClassSpec] = Field(default_factory=dict)
    templates: dict[str, ImpVMTemplateSpec] = Field(default_factory=dict)
    pools: dict[str, ImpVMRunnerPoolSpec] = Field(default_factory=dict)

    @field_validator("classes", "templates", "pools")
    @classmethod
    def _names(cls, v: dict[str, Any]) -> dict[str, Any]:
        import re

        for name in v:
            if len(name) > 63 or not re.fullmatch(NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not a valid object name (DNS label)")
        return v

    def listen(self) -> tuple[str, int]:
        """The operator's (host, port)."""
        host, _, port = self.operator.listen.rpartition(":")
        return host.strip("[]"), int(port)
