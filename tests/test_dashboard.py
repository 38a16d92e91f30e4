"""The Grafana dashboard (deploy/grafana/, carried verbatim by the chart) queries only metrics
the operator and the agent export, with the labels they carry, and shows every family."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.metric_families import exported_families, family_labels

DASHBOARD = REPO / "deploy" / "grafana" / "impvm-dashboard.json"
CHART_COPY = REPO / "charts" / "impvm" / "files" / "grafana" / "impvm-dashboard.json"
METRIC = re.compile(r"\b(impvm_[a-z0-9_]+)\b")
# a selector's label matchers: metric{label="x", other=~"y"}
SELECTOR = re.compile(r"\b(impvm_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
# by (...) / without (...) clauses name labels too
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def queries(node: Any) -> Iterator[str]:
    """Every PromQL text in the dashboard: panel targets and templating queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def family_of(name: str, families: dict[str, str]) -> str | None:
    """The exported family a series name belongs to (histogram series carry a suffix)."""
    if name in families:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and families.get(base) == "histogram":
            return base
    return None


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_query_names_an_exported_metric_and_its_labels() -> None:
    families = exported_families()
    labels = family_labels()
    texts = list(queries(load()))
    assert len(texts) > 10
    for text in texts:
        names = METRIC.findall(text)
        assert names, f"query names no impvm metric: {text}"
        for name in names:
            fam = family_of(name, families)
            assert fam is not None, f"{name} is not exported (query: {text})"
        known = set().union(*(labels[family_of(n, families) or n] for n in names))
        known |= {"le"}
        for metric, matchers in SELECTOR.findall(text):
            for label in MATCHER.findall(matchers):
                assert label in labels[family_of(metric, families) or metric], (label, text)
        for group in GROUPING.findall(text):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in known, (label, text)


def test_every_exported_family_has_a_panel() -> None:
    shown = {n for t in queries(load()) for n in METRIC.findall(t)}
    families = exported_families()
    shown_families = {family_of(n, families) for n in shown}
    assert set(families) - shown_families == set()


def test_panels_have_unique_ids_and_the_chart_carries_the_file_verbatim() -> None:
    dash = load()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["uid"] and dash["title"]
    hint = "out of sync: run scripts/sync-chart.sh"
    assert CHART_COPY.read_bytes() == DASHBOARD.read_bytes(), hint


@pytest.mark.parametrize("path", [DASHBOARD])
def test_datasource_is_a_variable(path: Path) -> None:
    """Importable into any Grafana: no data source uid is hard-coded."""
    text = path.read_text()
    uids = set(re.findall(r'"uid": "([^"]*)"', text)) - {load()["uid"]}
    assert uids == {"${datasource}"}, uids
