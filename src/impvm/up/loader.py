"""Loading ``impvm.yaml`` (:mod:`impvm.up.config`): YAML, unknown keys, the defaults a pool may
leave out, relative paths, the key files; every problem one :class:`ConfigError` naming the
field."""

from __future__ import annotations

import os
import stat
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from impvm.up.config import APP_SECRET, WEBHOOK_SECRET, ConfigError, UpConfig


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
