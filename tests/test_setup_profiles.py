"""scripts/setup.sh builds only what its caller needs: the real script, run against a fresh cache
with the Go module proxy turned off, so any Go build it starts fails at once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"


def _run(profile: str | None, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if not assets:
        pytest.skip("needs KUBEBUILDER_ASSETS (bash scripts/setup.sh)")
    env = dict(os.environ)
    env.update(
        IMPVM_CACHE_DIR=str(tmp_path / "cache"),
        GOPROXY="off",
        GOMODCACHE=str(tmp_path / "gomod"),
        GOCACHE=str(tmp_path / "gocache"),
        KUBEBUILDER_ASSETS=assets,
    )
    env.pop("IMPVM_CLUSTER_ASSETS", None)
    args = ["bash", str(SETUP)] + ([profile] if profile else [])
    return subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )


def test_stack_profile_builds_no_test_only_tool(tmp_path: Path) -> None:
    proc = _run("stack", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == os.environ["KUBEBUILDER_ASSETS"]
    cache = tmp_path / "cache"
    built = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert built == [], built
    for tool in ("helm", "cosign", "ServiceMonitor", "test cluster"):
        assert tool not in proc.stderr, proc.stderr


def test_tests_profile_is_the_default_and_builds_the_test_tools(tmp_path: Path) -> None:
    # with the module proxy off and a fresh cache, the first test-only Go build must fail
    proc = _run(None, tmp_path)
    assert proc.returncode != 0
    assert "cosign" in proc.stderr


def test_unknown_profile_is_refused(tmp_path: Path) -> None:
    proc = _run("everything", tmp_path)
    assert proc.returncode == 2
    assert "unknown profile 'everything'" in proc.stderr
