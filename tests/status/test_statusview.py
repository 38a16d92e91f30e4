"""The status summary and its rendering, from hand-made snapshots: counts, conditions with
reasons, VMs by phase and node, agents, rate limits, Warning Events; never ``None``."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from impvm.commands.statusview import Snapshot, cell, render, summarize

NOW = dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.UTC)


def text_of(doc: dict[str, Any]) -> str:
    console = Console(record=True, width=220, color_system=None)
    console.print(render(doc))
    return console.export_text()


def pool(name: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ci", "name": name},
        "spec": {
            "scaling": {"mode": "polling", "minIdle": 1, "maxConcurrent": 5},
            "platform": {"credentialsSecret": "gh-app"},
        },
        "status": status or {},
    }


def vm(name: str, phase: str | None, node: str | None, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ci",
            "name": name,
            "labels": {"imp.dev/runner-pool": "small"},
            "creationTimestamp": "2026-12-01T11:59:00Z",
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, **status} if phase else {},
    }


LEASE = {
    "metadata": {
        "name": "impvm-agent-node-1",
        "annotations": {
            "imp.dev/vcpu": "8",
            "imp.dev/memory-mib": "16384",
            "imp.dev/vcpu-used": "2",
            "imp.dev/memory-mib-used": "2048",
            "imp.dev/runtime": "qemu",
            "imp.dev/accelerator": "kvm",
            "imp.dev/preflight": "failed: umoci: not found on PATH (apt-get install umoci)",
        },
    },
    "spec": {
        "holderIdentity": "node-1",
        "renewTime": "2026-12-01T11:59:55Z",
        "leaseDurationSeconds": 40,
    },
}


def test_summary_and_table() -> None:
    status = {
        "idle": 1,
        "busy": 2,
        "starting": 0,
        "desired": 3,
        "pendingJobs": 0,
        "total": 3,
        "rateLimit": {"limit": 5000, "remaining": 4990, "resetAt": "2026-12-01T13:00:00Z"},
        "timings": {"jobPickup": {"count": 4, "p50Seconds": 2.5, "p95Seconds": 11.0}},
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Reconciled", "message": "ok"},
            {
                "type": "Unschedulable",
                "status": "True",
                "reason": "InsufficientCapacity",
                "message": "1 VM(s) wait for a node",
            },
            {"type": "RateLimited", "status": "False", "reason": "WithinLimits", "message": ""},
        ],
    }
    event = {
        "metadata": {"namespace": "ci"},
        "type": "Warning",
        "reason": "Unschedulable",
        "message": "1 VM(s) wait for a node",
        "involvedObject": {"kind": "ImpVMRunnerPool", "name": "small"},
        "lastTimestamp": "2026-12-01T11:59:30Z",
        "count": 3,
    }
    normal = dict(event, type="Normal", reason="ScaledUp")
    snap = Snapshot(
        NOW,
        pools=[pool("small", status), pool("fresh")],
        vms=[
            vm("a", "Running", "node-1"),
            vm("b", "Running", "node-1"),
            vm("c", None, None),
            vm(
                "d",
                "Failed",
                "node-1",
                exitReason="Error",
                message="a\nb\nqemu exited 1",
                consoleTail="a\nb\nqemu exited 1",
                consoleLog="node-1:/var/lib/impvm/consoles/ci.d.12345678.log",
            ),
        ],
        leases=[LEASE],
        events=[event, normal],
    )
    doc = summarize(snap)
    json.dumps(doc)  # the -o json document
    assert [(r["phase"], r["node"], r["count"]) for r in doc["vms"]["byPhase"]] == [
        ("Unbound", "-", 1),
        ("Running", "node-1", 2),
        ("Failed", "node-1", 1),
    ]
    assert [v["name"] for v in doc["vms"]["waitingForNode"]] == ["c"]
    (agent,) = doc["agents"]
    assert agent["live"] and agent["heartbeatAgeSeconds"] == 5.0 and agent["vcpuUsed"] == 2
    (limit,) = doc["rateLimits"]
    assert limit == {
        "installation": "ci/gh-app",
        "pools": ["small"],
        "limit": 5000,
        "remaining": 4990,
        "resetAt": "2026-12-01T13:00:00Z",
    }
    assert [e["reason"] for e in doc["events"]] == ["Unschedulable"]

    out = text_of(doc)
    assert "None" not in out
    assert "Unschedulable=True InsufficientCapacity: 1 VM(s) wait for a node" in out
    assert "Ready=True Reconciled" in out and "RateLimited" not in out
    assert "waiting for status" in out  # the pool the operator has not written yet
    assert "2/8" in out and "2048/16384" in out and "kvm" in out and "5.0s ago" in out
    assert "failed: umoci: not found on PATH" in out
    assert "4990/5000" in out and "(x3)" in out
    assert "2.5s / 11s (n=4)" in out  # job pickup p50 / p95 of the last hour
    assert "Error" in out and "qemu exited 1" in out and "impvm logs -n ci d" in out


def test_empty_cluster_and_lost_agent() -> None:
    lost = dict(LEASE, spec=dict(LEASE["spec"], renewTime="2026-12-01T11:50:00Z"))  # type: ignore[arg-type]
    out = text_of(summarize(Snapshot(NOW, leases=[lost])))
    assert "no pools" in out and "no VMs" in out and "(lost)" in out and "None" not in out


@given(
    st.dictionaries(
        st.sampled_from(["idle", "busy", "starting", "desired", "total"]),
        st.none() | st.integers(0, 9),
    )
)
def test_never_none_whatever_is_missing(status: dict[str, Any]) -> None:
    out = text_of(summarize(Snapshot(NOW, pools=[pool("p", status)])))
    assert "None" not in out


def test_cell() -> None:
    assert [cell(None), cell(""), cell(True), cell(3), cell(2.25, "s"), cell(12.6, "s")] == [
        "-",
        "-",
        "yes",
        "3",
        "2.2s",
        "13s",
    ]


def test_an_installation_pod_that_cannot_pull_its_image_says_why() -> None:
    def pod(name: str, component: str, container: dict[str, Any], phase: str) -> dict[str, Any]:
        return {
            "metadata": {
                "namespace": "impvm-system",
                "name": name,
                "labels": {"app.kubernetes.io/component": component},
            },
            "spec": {"nodeName": "node-1"},
            "status": {"phase": phase, "containerStatuses": [container]},
        }

    pull = "failed to resolve reference reg/impvm-agent@sha256:dead: not found"
    pods = [
        pod("impvm-agent-x", "agent", {"ready": False, "state": {"waiting": {
            "reason": "ImagePullBackOff", "message": pull}}}, "Pending"),
        pod("impvm-operator-y", "operator", {"ready": True, "state": {"running": {}}}, "Running"),
    ]  # fmt: skip
    doc = summarize(Snapshot(NOW, pods=pods))
    assert doc["podsNotReady"] == [
        {
            "namespace": "impvm-system",
            "pod": "impvm-agent-x",
            "component": "agent",
            "node": "node-1",
            "reason": "ImagePullBackOff",
            "message": pull,
        }
    ]
    text = text_of(doc)
    assert "Operator and agent pods not ready" in text and "ImagePullBackOff" in text
    assert "not ready" not in text_of(summarize(Snapshot(NOW, pods=pods[1:])))
