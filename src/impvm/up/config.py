"""The configuration file of ``impvm up`` (``impvm.yaml``): a pydantic model, and a loader that
turns every problem into one :class:`ConfigError` naming the field.

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
server-side dry run before anything runs (:mod:`impvm.up.service`).
"""

from __future__ import annotations

import os
import stat
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


# ------------------------------------------------------------------------------------- loading


def _model_of(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """(container, model) of an annotation: ``("", M)`` for ``M | None``, ``("list", M)``,
    ``("dict", M)``; ``None`` when no model is inside."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "", annotation
    if origin in (typing.Union, types.UnionType):
        for a in args:
            got = _model_of(a)
            if got is not None:
                return got
    if origin is list and args:
        inner = _model_of(args[0])
        return ("list", inner[1]) if inner and not inner[0] else None
    if origin is dict and len(args) == 2:
        inner = _model_of(args[1])
        return ("dict", inner[1]) if inner and not inner[0] else None
    return None


def unknown_fields(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
    """Dotted paths of keys in ``data`` that ``model`` (recursively) does not define. The API
    models ignore unknown keys (the API server prunes them); a config file must not, since a
    misspelt key would silently do nothing."""
    if not isinstance(data, dict):
        return []
    fields = {(f.alias or n): f for n, f in model.model_fields.items()}
    fields.update({n: f for n, f in model.model_fields.items()})
    out: list[str] = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        f = fields.get(key)
        if f is None:
            out.append(where)
            continue
        inner = _model_of(f.annotation)
        if inner is None:
            continue
        kind, sub = inner
        if kind == "" and isinstance(value, dict):
            out += unknown_fields(sub, value, where)
        elif kind == "list" and isinstance(value, list):
            for i, item in enumerate(value):
                out += unknown_fields(sub, item, f"{where}[{i}]")
        elif kind == "dict" and isinstance(value, dict):
            for k, item in value.items():
                out += unknown_fields(sub, item, f"{where}.{k}")
    return out


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _check_secret_file(field: str, path: Path, what: str) -> None:
    """Readable by its owner only, a regular file, not empty. Raises :class:`ConfigError`."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{field}: {path}: no such file") from None
    except PermissionError:
        raise ConfigError(f"{field}: {path}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{field}: {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{field}: {path}: not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{field}: {path} is accessible by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); it holds the {what}: chmod 600 it"
        )
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{field}: {path}: permission denied")
    if st.st_size == 0:
        raise ConfigError(f"{field}: {path} is empty")


def _check_private_key(field: str, path: Path) -> None:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        data = path.read_bytes()
    except PermissionError:
        raise ConfigError(f"{field}: {path}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{field}: {path}: {e.strerror or e}") from None
    try:
        load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        # the message never carries the file's content
        raise ConfigError(f"{field}: {path} is not an unencrypted PEM private key") from None


def _defaults(raw: dict[str, Any]) -> None:
    """Fill what a pool may leave out: the credentials Secret this file's App is written to,
    and the webhook Secret for webhook/hybrid pools."""
    has_webhook = bool((raw.get("github") or {}).get("webhookSecretFile"))
    for spec in (raw.get("pools") or {}).values():
        if not isinstance(spec, dict):
            continue
        platform = spec.get("platform")
        if isinstance(platform, dict):
            platform.setdefault("credentialsSecret", APP_SECRET)
        scaling = spec.get("scaling")
        if has_webhook and isinstance(scaling, dict):
            if scaling.get("mode") in ("webhook", "hybrid"):
                hook = scaling.setdefault("webhook", {})
                if isinstance(hook, dict):
                    hook.setdefault("secretRef", {"name": WEBHOOK_SECRET})


def _absolute(raw: dict[str, Any], base: Path) -> None:
    def fix(d: Any, key: str) -> None:
        if isinstance(d, dict) and isinstance(d.get(key), str) and d[key]:
            d[key] = str((base / d[key]).resolve()) if not Path(d[key]).is_absolute() else d[key]

    fix(raw, "dataDir")
    gh = raw.get("github")
    fix(gh, "webhookSecretFile")
    fix(gh.get("app") if isinstance(gh, dict) else None, "privateKeyFile")
    fix(raw.get("agent"), "qemuKernel")


def parse_config(text: str, source: str = "impvm.yaml", base: Path | None = None) -> UpConfig:
    """Parse and validate a configuration. ``base``: the directory relative paths are resolved
    against (default: the working directory). Checks the key files (present, readable, mode
    0600 or stricter, a PEM private key). Raises :class:`ConfigError` (one line: source, field,
    problem)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "cannot be parsed"
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, not {type(raw).__name__}")
    unknown = unknown_fields(UpConfig, raw)
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: unknown field")
    _defaults(raw)
    _absolute(raw, base or Path.cwd())
    try:
        cfg = UpConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = _loc(err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "required field missing"
        raise ConfigError(f"{source}: {where}: {msg}") from None
    key_field = f"{source}: github.app.privateKeyFile"
    _check_secret_file(key_field, cfg.github.app.private_key_file, "GitHub App private key")
    _check_private_key(key_field, cfg.github.app.private_key_file)
    if cfg.github.webhook_secret_file is not None:
        _check_secret_file(
            f"{source}: github.webhookSecretFile", cfg.github.webhook_secret_file, "webhook secret"
        )
    kernel = cfg.agent.qemu_kernel
    if kernel is not None and not kernel.is_file():
        # the agent would start and fail its preflight on every VM; say it here, once
        raise ConfigError(f"{source}: agent.qemuKernel: {kernel}: no such file")
    for name, pool in cfg.pools.items():
        mode = pool.scaling.mode if pool.scaling else "manual"
        if mode in ("webhook", "hybrid") and cfg.github.webhook_secret_file is None:
            ref = pool.scaling.webhook.secret_ref if pool.scaling and pool.scaling.webhook else None
            if ref is None or ref.name == WEBHOOK_SECRET:
                raise ConfigError(
                    f"{source}: pools.{name}.scaling.mode: {mode} needs "
                    "github.webhookSecretFile (or a scaling.webhook.secretRef you create)"
                )
    return cfg


def load_config(path: Path) -> UpConfig:
    """Read and validate ``path`` (see :func:`parse_config`). Raises :class:`ConfigError`."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (PermissionError, IsADirectoryError) as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    return parse_config(text, source=str(path), base=path.resolve().parent)
