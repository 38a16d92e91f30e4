"""Helpers and constants shared by the GitHub integration tests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from impvm.devstack.seed import make_private_key
from impvm.devstack.standin import StandIn

APP_ID = 4242
INSTALLATION_ID = 77
ORG = "octo-org"
REPO = "octo-org/app"
ALL_PERMISSIONS = {
    "organization_self_hosted_runners": "write",
    "administration": "write",
    "actions": "read",
    "metadata": "read",
}
NPM_ROOT = Path(__file__).resolve().parents[2] / "tools" / "npm" / "node_modules"


def make_key() -> str:
    """An App key in PKCS#8 form (the stand-in and the client also take PKCS#1)."""
    return make_private_key(pkcs8=True)


class RecordingSleep:
    """Injected sleep: records requested seconds, yields to the loop, does not wait."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        await asyncio.sleep(0)


class Clock:
    """Injected clock: real time plus an adjustable offset (seconds)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        import time

        return time.time() + self.offset


def api_requests(standin: StandIn, path: str | None = None) -> list[dict[str, Any]]:
    """The stand-in's request log (GitHub routes only), optionally for one templated path."""
    return [r for r in standin.state.requests if path is None or r["path"] == path]


async def control(standin: StandIn, method: str, path: str, body: Any = None) -> Any:
    """Call the stand-in's control API over HTTP."""
    async with httpx.AsyncClient(base_url=standin.url) as http:
        resp = await http.request(method, path, json=body)
        resp.raise_for_status()
        return resp.json() if resp.content else None


def webhook_examples() -> list[dict[str, Any]]:
    """All ``workflow_job`` examples from ``@octokit/webhooks-examples`` (installed by
    ``npm ci --prefix tools/npm``)."""
    index = NPM_ROOT / "@octokit" / "webhooks-examples" / "api.github.com" / "index.json"
    assert index.is_file(), f"{index} missing: run `npm ci --prefix tools/npm`"
    events = json.loads(index.read_text())
    (entry,) = [e for e in events if e["name"] == "workflow_job"]
    examples: list[dict[str, Any]] = entry["examples"]
    return examples
