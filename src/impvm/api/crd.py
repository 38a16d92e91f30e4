"""Render CustomResourceDefinitions from the API models (:mod:`impvm.api.models`).

pydantic's JSON Schema is turned into a Kubernetes *structural* OpenAPI v3 schema: ``$ref`` is
inlined, ``Optional[X]`` becomes ``X`` (absent from ``required``), titles and ``null`` defaults
are dropped, and each model's ``cel_rules`` become ``x-kubernetes-validations``. See the Kubernetes
docs, "Extend the Kubernetes API with CustomResourceDefinitions" (structural schemas, CEL rules).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from impvm.api.models import GROUP, KINDS, VERSION, ApiModel

_DROP_KEYS = {"title", "additionalProperties", "discriminator"}


def _model_rules(model: type[BaseModel]) -> dict[str, list[dict[str, Any]]]:
    """Map each model's JSON Schema title (its class name) to its CEL rules, recursively."""
    out: dict[str, list[dict[str, Any]]] = {}
    seen: set[type[BaseModel]] = set()

    def walk(m: type[BaseModel]) -> None:
        if m in seen:
            return
        seen.add(m)
        rules = getattr(m, "cel_rules", [])
        if rules:
            out[m.__name__] = list(rules)
        for f in m.model_fields.values():
            for t in _model_types(f.annotation):
                walk(t)

    walk(model)
    return out


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.append(annotation)
    for arg in getattr(annotation, "__args__", ()) or ():
        found.extend(_model_types(arg))
    return found


def _structural(node: Any, defs: dict[str, Any], rules: dict[str, list[dict[str, Any]]]) -> Any:
    """Rewrite one pydantic JSON Schema node into a structural schema node."""
    if isinstance(node, list):
        return [_structural(n, defs, rules) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        name = node.pop("$ref").rsplit("/", 1)[-1]
        target = copy.deepcopy(defs[name])
        if "enum" in target:
            target.pop("description", None)  # an enum class's docstring is not the field's
        target.update(node)  # keep the field's own description
        node = target
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot render a union into a structural schema: {options!r}")
        merged = dict(options[0])
        merged.update(node)
        node = _structural(merged, defs, rules)
        return node
    title = node.get("title")
    if node.get("type") == "object" and title in rules:
        node.setdefault("x-kubernetes-validations", []).extend(rules[title])
    if node.get("default", 0) is None:
        node.pop("default")
    for k in _DROP_KEYS:
        if k == "additionalProperties" and isinstance(node.get(k), dict):
            continue  # a map type keeps its value schema
        node.pop(k, None)
    if "const" in node:  # Literal with one value; structural schemas have no const
        node["enum"] = [node.pop("const")]
    if node.get("format") == "date-time":
        node["type"] = "string"
    if "properties" in node:
        node["properties"] = {k: _structural(v, defs, rules) for k, v in node["properties"].items()}
    if "items" in node:
        node["items"] = _structural(node["items"], defs, rules)
    if "additionalProperties" in node:
        node["additionalProperties"] = _structural(node["additionalProperties"], defs, rules)
    return node


def openapi_schema(kind: type[ApiModel]) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one kind: apiVersion, kind, metadata, spec and status."""
    raw = kind.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    rules = _model_rules(kind)
    body = _structural(raw, defs, rules)
    props = body["properties"]
    props.pop("kind", None)
    schema: dict[str, Any] = {
        "type": "object",
        "description": (kind.__doc__ or "").strip().split("\n\n")[0],
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "imp.dev/v1alpha1."},
            "kind": {"type": "string", "description": f"{getattr(kind, 'kind', '')}."},
            "metadata": {"type": "object"},
            **props,
        },
    }
    object_rules = getattr(kind, "object_rules", None)
    if object_rules:
        schema["x-kubernetes-validations"] = list(object_rules)
    return schema


def crd(kind: type[ApiModel]) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind, as a dict ready for YAML or the API."""
    k: str = kind.kind  # type: ignore[attr-defined]
    plural: str = kind.plural  # type: ignore[attr-defined]
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": openapi_schema(kind)},
    }
    if "status" in kind.model_fields:
        version["subresources"] = {"status": {}}
    fields = getattr(kind, "selectable_fields", None)
    if fields:
        version["selectableFields"] = fields
    columns = getattr(kind, "printer_columns", None)
    if columns:
        version["additionalPrinterColumns"] = columns
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced" if kind.namespaced else "Cluster",  # type: ignore[attr-defined]
            "names": {
                "kind": k,
                "listKind": f"{k}List",
                "plural": plural,
                "singular": k.lower(),
                "shortNames": kind.short_names,  # type: ignore[attr-defined]
                "categories": ["imp"],
            },
            "versions": [version],
        },
    }


def all_crds() -> list[dict[str, Any]]:
    """Every CRD, in :data:`impvm.api.models.KINDS` order."""
    return [crd(k) for k in KINDS]


def render_yaml() -> str:
    """All CRDs as one multi-document YAML stream (what ``impvm crds`` prints)."""
    header = "# Generated by `impvm crds` from src/impvm/api/models.py. Do not edit.\n"
    docs = [yaml.safe_dump(c, sort_keys=False, width=100) for c in all_crds()]
    return header + "---\n".join(docs)
