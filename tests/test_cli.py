"""The ``impvm`` command's help: flags read as flags."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["--help"], ["operator", "--help"], ["dev", "up", "--help"]])
def test_help_shows_flags_without_a_value(args: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "impvm.cli", *args], capture_output=True, text=True, check=True
    ).stdout
    assert "<bool>" not in out and "<list" not in out, out
    assert "--help" in out


def test_operator_help_names_the_safety_poll_period() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "impvm.cli", "operator", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--webhook-safety-poll-seconds" in out
