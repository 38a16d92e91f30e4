"""docs/security.md names the test that proves each "cannot": every one must exist, so the
threat model cannot drift from the tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def test_every_test_named_in_the_threat_model_exists() -> None:
    named = NAMED.findall((ROOT / "docs" / "security.md").read_text())
    assert len(named) >= 15
    missing = []
    for path, name in named:
        file = ROOT / path
        tree = ast.parse(file.read_text()) if file.exists() else ast.Module(body=[])
        defs = {
            n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        if name not in defs:
            missing.append(f"{path}::{name}")
    assert missing == []


def test_every_actor_section_names_a_test() -> None:
    """Each actor's "cannot" is proved by at least one named test, the local user included."""
    text = (ROOT / "docs" / "security.md").read_text()
    actors = text.split("## Actors", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"^### ", actors, flags=re.MULTILINE)[1:]
    assert len(sections) >= 6
    untested = [s.splitlines()[0] for s in sections if not NAMED.search(s)]
    assert untested == []
