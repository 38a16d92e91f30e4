"""No private key, installation token or JIT config in logs, exception texts or metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import traceback

import pytest
from gh_support import APP_ID, INSTALLATION_ID, ORG, REPO, RecordingSleep, control
from prometheus_client import REGISTRY, generate_latest
from pydantic import SecretStr

from impvm.devstack.standin import StandIn
from impvm.github import AppCredentials, GitHubClient, RetryPolicy, Scope
from impvm.github.errors import GitHubError


async def test_no_secret_in_logs_exceptions_or_metrics(
    standin: StandIn,
    client: GitHubClient,
    private_key: str,
    other_key: str,
    sleep: RecordingSleep,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []

    async def expect_error(coro: object) -> None:
        try:
            await coro  # type: ignore[misc]
        except GitHubError as exc:
            texts.extend([str(exc), repr(exc), "".join(traceback.format_exception(exc))])
        else:
            raise AssertionError("expected a GitHubError")

    org = Scope(org=ORG)
    jits = [
        await client.generate_jitconfig(org, "leak-1", 1, ["linux"]),
        await client.generate_jitconfig(Scope(repo=REPO), "leak-2", 1, ["linux"]),
    ]
    texts += [repr(j) + str(j) for j in jits] + [repr(client)]
    await expect_error(client.generate_jitconfig(org, "leak-1", 1, ["linux"]))  # 409
    await client.list_runners(org)
    await client.list_runs(REPO, "queued")
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {
            "kind": "status",
            "status": 500,
            "count": 50,
            "message": "boom",
            "path": "/orgs/{org}/actions/runners",
        },
    )
    await expect_error(client.list_runners(org))
    await control(standin, "DELETE", "/_standin/failures")
    limited = GitHubClient(
        client_credentials := AppCredentials(APP_ID, INSTALLATION_ID, SecretStr(private_key)),
        api_url=standin.url,
        sleep=sleep,
        retry=RetryPolicy(max_rate_limit_wait=1),
    )
    texts.append(repr(client_credentials))
    await control(
        standin, "POST", "/_standin/failures", {"kind": "primary_rate_limit", "reset_in": 500}
    )
    await expect_error(limited.list_runs(REPO, "completed"))
    standin.state.installations[INSTALLATION_ID].permissions = {"metadata": "read"}
    await expect_error(limited.generate_jitconfig(org, "leak-3", 1, ["linux"]))
    standin.state.installations[INSTALLATION_ID].suspended = True
    await expect_error(client.list_runners(org))
    wrong = GitHubClient(
        AppCredentials(APP_ID, INSTALLATION_ID, SecretStr(other_key)), api_url=standin.url
    )
    await expect_error(wrong.list_runners(org))
    standin.state.installations[INSTALLATION_ID].suspended = False
    # A stand-in runner's output.
    env = dict(
        os.environ,
        ACTIONS_RUNNER_INPUT_JITCONFIG=jits[0].encoded_jit_config.get_secret_value(),
        IMPVM_STANDIN_RUNNER_IDLE_TIMEOUT="0.5",
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "impvm.devstack.standin_runner",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    texts.append(out.decode())
    texts += [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    texts.append(caplog.text)
    texts.append(generate_latest(REGISTRY).decode())

    secrets = [t for t in standin.state.tokens]
    secrets += [j.encoded_jit_config.get_secret_value() for j in jits]
    secrets += [r.session_token for r in standin.state.runners.values()]
    key_lines = [line for line in private_key.splitlines() if len(line) > 40]
    assert len(standin.state.tokens) >= 4 and key_lines and len(secrets) >= 6
    haystack = "\n".join(texts)
    # The texts were captured: error texts, library logs, metrics, runner output.
    assert "GitHub 409" in haystack and "rate limit" in haystack
    assert "HTTP Request" in haystack and "impvm_github_api_calls_total" in haystack
    assert "leak-1" in haystack
    for secret in [*secrets, *key_lines, private_key]:
        assert secret not in haystack
