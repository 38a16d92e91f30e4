"""docs/configuration.md is exactly what the models render, and names every field."""

from __future__ import annotations

import subprocess
import sys

from impvm.api.models import ImpVMRunnerPoolSpec
from impvm.commands.docgen import render
from impvm.up.config import AgentConfig
from tests.conftest import REPO


def test_configuration_reference_matches_the_models() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is out of sync with the models; "
        "run: python -m impvm.commands.docgen > docs/configuration.md"
    )


def test_every_field_is_documented() -> None:
    text = render()
    for model in (ImpVMRunnerPoolSpec, AgentConfig):
        for name, info in model.model_fields.items():
            wire = info.alias or info.serialization_alias or name
            if wire == name and model is ImpVMRunnerPoolSpec:
                wire = "".join(
                    w if i == 0 else w.capitalize() for i, w in enumerate(name.split("_"))
                )
            assert f"| `{wire}` |" in text, (model.__name__, wire)
    assert "None" not in text


def test_the_module_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "impvm.commands.docgen"], capture_output=True, text=True, check=True
    ).stdout
    assert out == render()
