"""docs/troubleshooting.md documents every condition reason, VM exit reason and Event reason
the code can emit: the literal ones found in the source, and those built from names (GitHub
error classes, rate-limit kinds, the reaper's Event prefix)."""

from __future__ import annotations

import re

from impvm.github import errors
from impvm.operator import reaper
from tests.conftest import REPO

DOC = REPO / "docs" / "troubleshooting.md"
SRC = REPO / "src" / "impvm"

PATTERNS = [
    re.compile(r'EventSpec\(\s*"([A-Za-z]+)"'),
    re.compile(r'Emit\(\s*"([A-Za-z]+)"'),
    re.compile(r'ReapEvent\(\s*"([A-Za-z]+)"'),
    re.compile(r'conds\.set\(\s*"\w+",\s*(?:True|False),\s*"([A-Za-z]+)"'),
    re.compile(r'ready_failure = \(\s*"([A-Za-z]+)"'),
    re.compile(r'ready_failure or \(\s*"([A-Za-z]+)"'),
    re.compile(r'failure=\(\s*"([A-Za-z]+)"'),
    re.compile(r'_fail\(\s*obs,\s*Why\.\w+,\s*"([A-Za-z]+)"'),
    re.compile(r'_event\(kube, raw, "([A-Za-z]+)"'),
    re.compile(r'error_reason\s*=\s*"([A-Za-z]+)"'),
    re.compile(r'ok, reason = \w+, "([A-Za-z]+)"'),
    re.compile(r'"exitReason": "([A-Za-z]+)"'),
    re.compile(r'Unschedulable\("([A-Za-z]+)"'),
    re.compile(r'reason = "([A-Za-z]+)"'),
    re.compile(r'\breason="([A-Z][A-Za-z]+)",'),  # events.record(..., reason="X", ...)
]


def emitted() -> set[str]:
    found: set[str] = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for pat in PATTERNS:
            found |= set(pat.findall(text))
    return found


def test_the_scan_finds_what_it_should() -> None:
    found = emitted()
    for r in ("ScaledUp", "Unschedulable", "InsufficientCapacity", "NoAgents", "ConsoleLogKept"):
        assert r in found
    assert {"StartTimeout", "ImagePullFailed", "PassComplete", "RunnerReaped"} <= found


def test_every_reason_is_documented() -> None:
    doc = DOC.read_text()
    reasons = emitted()
    # built from names: the GitHub error classes the conditions carry, rate-limit kinds, and
    # the reaper's "Reaper<reason>" Events
    reasons |= {
        "BadCredentials",
        "PermissionNotGranted",
        "InstallationUnavailable",
        "TransientError",
        "RequestRejected",
        "PrimaryRateLimit",
        "SecondaryRateLimit",
        "CredentialsError",
        "GitHubError",
    }
    assert hasattr(errors, "TransientError") and hasattr(errors, "RequestRejected")
    reaper_reasons = {"NotJudged", "DeleteFailed", "ListFailed", "TokenRefused", "Failed"}
    reasons |= {f"Reaper{r}" for r in reaper_reasons | {"TokenUnavailable", "CredentialsInvalid"}}
    assert reaper.CONDITION_TYPE == "Reaper"
    missing = sorted(r for r in reasons if f"`{r}`" not in doc)
    assert not missing, f"document these in docs/troubleshooting.md: {missing}"
