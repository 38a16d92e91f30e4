"""Bad input on the real cluster: a values file the chart's schema rejects fails `helm install`
naming the field and installs nothing; an agent image digest that does not exist leaves the
agent pods unable to pull, which their Events and `impvm status` say."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from impvm.devstack.cluster import Cluster
from tests.cluster.conftest import ClusterImages
from tests.cluster.test_chart_e2e import helm_binary, items
from tests.conftest import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

NS, RELEASE = "impvm-bad", "bad"
MISSING = "sha256:" + "0" * 64


def test_a_rejected_values_file_and_a_missing_digest_say_what_is_wrong(
    tmp_path: Path, cluster: Cluster, cluster_images: ClusterImages
) -> None:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    helm = str(helm_binary())
    registry, _, op_digest = cluster_images.operator.partition("@")
    agent_repo = cluster_images.agent.partition("@")[0]
    values = {
        "operator": {
            "image": {"repository": registry, "digest": op_digest},
            "watchNamespaces": [NS],
        },
        "agent": {"image": {"repository": agent_repo, "digest": MISSING}},
    }
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump({**values, "vmPods": {"milliCPUPerVCPU": 0}}))
    cmd = [helm, "install", RELEASE, str(REPO / "charts" / "impvm"), "-n", NS]
    out = subprocess.run(
        [*cmd, "--create-namespace", "--values", str(bad)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert "vmPods/milliCPUPerVCPU" in out.stderr, out.stderr
    listed = subprocess.run(
        [helm, "list", "-n", NS, "-q"], env=env, capture_output=True, text=True, timeout=60
    )
    assert RELEASE not in listed.stdout.split()

    good = tmp_path / "values.yaml"
    good.write_text(yaml.safe_dump(values))
    try:
        cluster.kubectl("label", "--overwrite", "node", "node-1", "node-2", "imp.dev/agent=true")
        out = subprocess.run(
            [*cmd, "--create-namespace", "--values", str(good)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 300
        while True:
            status = subprocess.run(
                [str(REPO / ".venv" / "bin" / "impvm"), "status", "-o", "json", "-n", NS],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            # a refusal while the API server settles after the install (e.g. "storage is
            # (re)initializing" as the chart's CRDs are applied) is one line and exit 1: ask again
            stuck = [
                p
                for p in (
                    json.loads(status.stdout)["podsNotReady"] if status.returncode == 0 else []
                )
                if p["namespace"] == NS
                and p["component"] == "agent"
                and p["reason"] in ("ErrImagePull", "ImagePullBackOff")
            ]
            if len(stuck) == 2:
                break
            assert time.monotonic() < deadline, (status.returncode, status.stdout, status.stderr)
            time.sleep(2)
        assert all(MISSING.removeprefix("sha256:") in p["message"] for p in stuck), stuck
        assert sorted(p["node"] for p in stuck) == ["node-1", "node-2"]
        events = items(cluster, "events", "-n", NS, "--field-selector", "reason=Failed")
        pulls = [e for e in events if "Failed to pull image" in e.get("message", "")]
        assert pulls and all(MISSING.removeprefix("sha256:") in e["message"] for e in pulls)
    finally:
        subprocess.run(
            [helm, "uninstall", RELEASE, "-n", NS], env=env, capture_output=True, timeout=300
        )
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
