"""Fixtures of the chart tests: the helm CLI (built from its Go module by scripts/build-helm.sh,
cached) and helpers that render charts/impvm and hand the result to the real kube-apiserver."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import Client
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace

from impvm.kube.controlplane import ControlPlane
from tests.conftest import REPO

CHART = REPO / "charts" / "impvm"
FULL_VALUES = Path(__file__).parent / "full-values.yaml"
NODE_POOLS = Path(__file__).parent / "node-pools-values.yaml"
NAMESPACE = "impvm-system"


@dataclass
class Helm:
    """The helm binary, run against charts/impvm."""

    path: Path

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.path), *args], capture_output=True, text=True, check=False, timeout=120
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
        return proc

    def template(
        self, *args: str, release: str = "impvm", namespace: str = NAMESPACE
    ) -> list[dict[str, Any]]:
        """``helm template RELEASE charts/impvm -n NAMESPACE ARGS``, parsed (empty documents
        dropped)."""
        out = self.run("template", release, str(CHART), "--namespace", namespace, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    def template_text(self, *args: str, release: str = "impvm") -> str:
        return self.run("template", release, str(CHART), "--namespace", NAMESPACE, *args).stdout


@pytest.fixture(scope="session")
def helm() -> Helm:
    """helm from scripts/build-helm.sh (fails, not skips, when it cannot be built: setup.sh
    builds it)."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-helm.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"scripts/build-helm.sh failed:\n{proc.stderr[-3000:]}"
    return Helm(Path(proc.stdout.strip().splitlines()[-1]))


@dataclass
class Kubectl:
    """kubectl of the test control plane, as its admin."""

    path: Path
    kubeconfig: Path

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.path), "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
        return proc

    def raw(self, path: str) -> Any:
        return json.loads(self.run("get", "--raw", path).stdout)


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Kubectl:
    return Kubectl(control_plane.kubectl, control_plane.kubeconfig)


@pytest.fixture(scope="session")
def release_namespace(kube: Client) -> str:
    """impvm-system on the session's control plane (kept: other tests may use it too)."""
    try:
        kube.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
    except ApiError as e:
        if e.status.code != 409:
            raise
    return NAMESPACE


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in by_kind(docs, kind)])
    return found[0]
