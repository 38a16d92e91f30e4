"""The committed CRDs are exactly what the models render."""

from __future__ import annotations

import subprocess
import sys

from impvm.api.crd import render_yaml
from tests.conftest import REPO


def test_committed_crds_match_models() -> None:
    committed = (REPO / "deploy" / "crds" / "imp.dev_crds.yaml").read_text()
    assert committed == render_yaml(), (
        "deploy/crds/imp.dev_crds.yaml is out of sync with src/impvm/api/models.py; "
        "run: impvm crds > deploy/crds/imp.dev_crds.yaml"
    )


def test_cli_crds_prints_the_same() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "impvm.cli", "crds"], capture_output=True, text=True, check=True
    ).stdout
    assert out == render_yaml()


def test_cli_version_and_placeholders() -> None:
    v = subprocess.run(
        [sys.executable, "-m", "impvm.cli", "--version"], capture_output=True, text=True
    )
    assert v.returncode == 0 and v.stdout.startswith("impvm ")
