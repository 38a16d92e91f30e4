"""Render ``docs/configuration.md`` from the models: every field of the custom resources
(:mod:`impvm.api.models`) and of ``impvm.yaml`` (:mod:`impvm.up.config`) with its wire name,
type, default, limits and description. ``python -m impvm.commands.docgen > docs/configuration.md``;
tests/test_docs_in_sync.py fails while the file differs."""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from impvm.api.models import API_VERSION, KINDS
from impvm.up.config import UpConfig

HEADER = """# Configuration reference

Generated from the models by `python -m impvm.commands.docgen > docs/configuration.md` (a test fails
while this file differs): every field of the custom resources (API `{api}`) and of `impvm.yaml`
(the file `impvm up` reads). Names are the wire names (camelCase); "-" means no default (a
required field has `required`). Limits are enforced by the API server (CRD schema and CEL rules)
or by the configuration loader (one line naming the field, exit 2).
"""


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation refers to (through Optional, list, dict, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models(arg)
    return out


def _type(annotation: Any) -> str:
    """A short, readable type: ``integer``, ``string``, ``[X]``, ``{string: X}``, enum values."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (list, tuple, set, frozenset):
        return f"[{_type(args[0])}]" if args else "list"
    if origin is dict:
        return f"{{{_type(args[0])}: {_type(args[1])}}}" if len(args) == 2 else "object"
    if origin is typing.Annotated:
        return _type(args[0])
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " \\| ".join(f"`{m.value}`" for m in annotation)
        if issubclass(annotation, BaseModel):
            return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
        names = {int: "integer", str: "string", bool: "boolean", float: "number"}
        if annotation in names:
            return names[annotation]
        return {"datetime": "time (RFC 3339)", "Path": "path"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation).replace("typing.", "")


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value: Any = info.default_factory()  # type: ignore[call-arg]
    else:
        value = info.default
    if value is None or value is PydanticUndefined:
        return "-"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        value = str(value).lower()
    return f"`{value}`" if value not in ("", [], {}) else f"`{value!r}`"


def _limits(info: FieldInfo) -> str:
    out = []
    for m in info.metadata:
        if isinstance(m, Ge):
            out.append(f">= {m.ge}")
        elif isinstance(m, Gt):
            out.append(f"> {m.gt}")
        elif isinstance(m, Le):
            out.append(f"<= {m.le}")
        elif isinstance(m, Lt):
            out.append(f"< {m.lt}")
        elif isinstance(m, MaxLen):
            out.append(f"at most {m.max_length} long")
        elif isinstance(m, MinLen):
            out.append(f"at least {m.min_length} long")
        elif getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
    return ", ".join(out).replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(model: type[BaseModel]) -> list[str]:
    doc = _cell((model.__doc__ or "").strip())
    lines = [f"### {model.__name__}", "", doc, ""] if doc else [f"### {model.__name__}", ""]
    lines += [
        "| field | type | default | limits | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, info in model.model_fields.items():
        gen = model.model_config.get("alias_generator")
        wire = info.alias or (gen(name) if callable(gen) else name)
        lines.append(
            f"| `{wire}` | {_type(info.annotation)} | {_default(info)} | {_limits(info)} | "
            f"{_cell(info.description or '')} |"
        )
    return [*lines, ""]


def _section(title: str, intro: str, roots: list[type[BaseModel]]) -> list[str]:
    seen: list[type[BaseModel]] = []

    def walk(m: type[BaseModel]) -> None:
        if m in seen:
            return
        seen.append(m)
        for info in m.model_fields.values():
            for sub in _models(info.annotation):
                walk(sub)

    for r in roots:
        walk(r)
    out = [f"## {title}", "", intro, ""]
    for m in seen:
        out += _table(m)
    return out


def render() -> str:
    """The whole of ``docs/configuration.md``."""
    specs: list[type[BaseModel]] = []
    for kind in KINDS:
        spec = kind.model_fields["spec"].annotation
        specs += _models(spec)
    lines = [HEADER.format(api=API_VERSION)]
    lines += _section(
        "Custom resources",
        "The `spec` of each kind (`status` is written by impvm and described in "
        "`kubectl explain`). `ImpVMClass` is cluster-scoped; the others are namespaced.",
        specs,
    )
    lines += _section(
        "impvm.yaml",
        "The configuration of `impvm up` (one machine: control plane, operator, agent).",
        [UpConfig],
    )
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(render(), end="")
