"""The ``impvm`` command's help: flags read as flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


UNREACHABLE = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.parametrize("command", [["status"], ["status", "-o", "json"], ["logs", "some-vm"]])
@pytest.mark.parametrize("kubeconfig", ["apiVersion: v1\nclusters: [\n  bad", UNREACHABLE])
def test_a_bad_kubeconfig_or_an_unreachable_server_is_one_line_and_exit_2(
    tmp_path: Path, command: list[str], kubeconfig: str
) -> None:
    f = tmp_path / "kubeconfig"
    f.write_text(kubeconfig)
    got = subprocess.run(
        [sys.executable, "-m", "impvm.cli", *command, "--kubeconfig", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 2, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr


@pytest.mark.parametrize("command", [["operator"], ["agent", "--workdir"]])
@pytest.mark.parametrize(
    "kubeconfig",
    [
        None,
        "just a string",
        "apiVersion: v1\nclusters: [\n  bad",
        UNREACHABLE.replace("insecure-skip-tls-verify: true", "certificate-authority: /no/ca.crt"),
    ],
)
def test_a_component_without_a_usable_kubeconfig_is_one_line_and_exit_2(
    tmp_path: Path, command: list[str], kubeconfig: str | None
) -> None:
    if command[-1] == "--workdir":
        command = [*command, str(tmp_path / "agent")]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no ~/.kube, not in a cluster
    if kubeconfig is not None:
        (tmp_path / "kubeconfig").write_text(kubeconfig)
        env["KUBECONFIG"] = str(tmp_path / "kubeconfig")
    got = subprocess.run(
        [sys.executable, "-m", "impvm.cli", *command],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert got.returncode == 2, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr
    assert "no usable kubeconfig" in got.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["doctor", "-o", "yaml"],
        ["agent", "--operator-url", "http://127.0.0.1:1", "--runtime", "bogus", "--workdir"],
        ["agent", "--operator-url", "http://127.0.0.1:1", "--guest-network", "host", "--workdir"],
    ],
)
def test_an_unknown_choice_is_one_line_and_exit_2(tmp_path: Path, args: list[str]) -> None:
    if args[-1] == "--workdir":
        args = [*args, str(tmp_path / "agent")]
    got = subprocess.run(
        [sys.executable, "-m", "impvm.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip().splitlines()[-1].startswith(f"impvm {args[0]}: ")
    assert "Traceback" not in got.stderr


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_poll_budget_that_is_not_a_finite_number_is_refused(value: str) -> None:
    got = subprocess.run(
        [sys.executable, "-m", "impvm.cli", "operator", "--poll-calls-per-hour", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 2 and "--poll-calls-per-hour" in got.stderr, got.stderr


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"image": "reg/agent@sha256:' + "1" * 64 + '", "overheadMiB": -1}', "overheadMiB"),
        ('{"image": "reg/a", "milliCPUPerVCPU": 5000}', "milliCPUPerVCPU"),
        ('{"image": "reg/a", "nodeSelector": {"a": "b"}}', "nodeSelector"),  # unknown key
        ('{"overheadMiB": 1}', "image"),
        ("not json", "(the file)"),
    ],
)
def test_a_bad_vm_pods_file_names_the_field_and_exits_2(
    tmp_path: Path, text: str, field: str
) -> None:
    f = tmp_path / "vm-pods.json"
    f.write_text(text)
    got = subprocess.run(
        [sys.executable, "-m", "impvm.cli", "operator", "--vm-pods", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
    )
    assert got.returncode == 2, got.stderr
    assert "--vm-pods" in got.stderr and field in got.stderr, got.stderr
    assert "Traceback" not in got.stderr
