"""Rate limits (primary, secondary), 5xx and timeout retries, bounded retries."""

from __future__ import annotations

import time

import httpx
import pytest
from gh_support import ORG, RecordingSleep, api_requests, control

from impvm.devstack.standin import StandIn
from impvm.github import AppCredentials, GitHubClient, RetryPolicy, Scope
from impvm.github.errors import RateLimited, TransientError

GROUPS = "/orgs/{org}/actions/runner-groups"


async def _warm(client: GitHubClient, standin: StandIn) -> None:
    """Mint the token first so injected failures hit the call under test."""
    await client.runner_group_id(ORG)
    standin.state.requests.clear()


async def test_primary_rate_limit_waits_until_reset(
    standin: StandIn, client: GitHubClient, sleep: RecordingSleep
) -> None:
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "primary_rate_limit", "path": GROUPS, "reset_in": 40},
    )
    assert await client.runner_group_id(ORG) == 1
    assert [r["status"] for r in api_requests(standin, GROUPS)] == [403, 304]
    assert len(sleep.calls) == 1
    assert 38 <= sleep.calls[0] <= 42  # until x-ratelimit-reset (+1 s)


async def test_secondary_rate_limit_honours_retry_after(
    standin: StandIn, client: GitHubClient, sleep: RecordingSleep
) -> None:
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "secondary_rate_limit", "path": GROUPS, "retry_after": 7},
    )
    assert await client.runner_group_id(ORG) == 1
    assert [r["status"] for r in api_requests(standin, GROUPS)] == [403, 304]
    assert sleep.calls == [7.0]


async def test_secondary_rate_limit_without_retry_after_backs_off_exponentially(
    standin: StandIn, client: GitHubClient, sleep: RecordingSleep
) -> None:
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "secondary_rate_limit", "path": GROUPS, "count": 2},
    )
    assert await client.runner_group_id(ORG) == 1
    assert [r["status"] for r in api_requests(standin, GROUPS)] == [403, 403, 304]
    assert sleep.calls == [60.0, 120.0]


async def test_rate_limit_beyond_bound_raises_with_retry_after(
    standin: StandIn, credentials: AppCredentials, sleep: RecordingSleep
) -> None:
    client = GitHubClient(
        credentials,
        api_url=standin.url,
        sleep=sleep,
        retry=RetryPolicy(max_rate_limit_wait=30.0),
    )
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "primary_rate_limit", "path": GROUPS, "reset_in": 600},
    )
    with pytest.raises(RateLimited) as info:
        await client.runner_group_id(ORG)
    assert info.value.kind == "primary"
    assert 590 <= info.value.retry_after <= 602
    assert sleep.calls == []
    assert len(api_requests(standin, GROUPS)) == 1


async def test_real_rate_limit_accounting(standin: StandIn, credentials: AppCredentials) -> None:
    """The stand-in's own bucket runs out; the client really waits for the reset."""
    client = GitHubClient(credentials, api_url=standin.url)
    await _warm(client, standin)
    await control(standin, "POST", "/_standin/rate-limit", {"remaining": 1, "reset_in": 1})
    started = time.monotonic()
    scope = Scope(org=ORG)
    await client.generate_jitconfig(scope, "rl-1", 1, ["linux"])  # uses the last request
    await client.generate_jitconfig(scope, "rl-2", 1, ["linux"])  # 403, waits for the reset
    jit_path = "/orgs/{org}/actions/runners/generate-jitconfig"
    assert [r["status"] for r in api_requests(standin, jit_path)] == [201, 403, 201]
    assert time.monotonic() - started >= 0.5


async def test_5xx_is_retried_with_backoff(
    standin: StandIn, client: GitHubClient, sleep: RecordingSleep
) -> None:
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "status", "status": 502, "path": "/orgs/{org}/actions/runners", "count": 2},
    )
    assert await client.list_runners(Scope(org=ORG)) == []
    statuses = [r["status"] for r in api_requests(standin, "/orgs/{org}/actions/runners")]
    assert statuses == [502, 502, 200]
    assert len(sleep.calls) == 2
    assert 0.5 <= sleep.calls[0] <= 1.0 and 1.0 <= sleep.calls[1] <= 2.0


async def test_5xx_retries_are_bounded(
    standin: StandIn, client: GitHubClient, sleep: RecordingSleep
) -> None:
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "status", "status": 503, "path": GROUPS, "count": 100},
    )
    with pytest.raises(TransientError) as info:
        await client.runner_group_id(ORG)
    assert info.value.status == 503
    assert len(api_requests(standin, GROUPS)) == 4  # 1 + max_transient_retries (3)
    assert len(sleep.calls) == 3


async def test_timeout_is_retried(
    standin: StandIn, credentials: AppCredentials, sleep: RecordingSleep
) -> None:
    client = GitHubClient(credentials, api_url=standin.url, sleep=sleep, timeout=0.3)
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "timeout", "delay": 1.0, "path": GROUPS},
    )
    assert await client.runner_group_id(ORG) == 1
    assert len(api_requests(standin, GROUPS)) == 2
    assert len(sleep.calls) == 1


async def test_token_mint_5xx_is_retried(
    standin: StandIn, client: GitHubClient, sleep: RecordingSleep
) -> None:
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {
            "kind": "status",
            "status": 500,
            "path": "/app/installations/{installation_id}/access_tokens",
        },
    )
    assert await client.runner_group_id(ORG) == 1
    statuses = [
        r["status"]
        for r in api_requests(standin, "/app/installations/{installation_id}/access_tokens")
    ]
    assert statuses == [500, 201]


async def test_a_share_of_calls_fails_with_5xx(standin: StandIn, client: GitHubClient) -> None:
    """``probability``: each matching request fails with that chance, and only a request that
    failed uses up ``count`` (the chaos benchmark's "20 % of GitHub calls fail")."""
    await _warm(client, standin)
    await control(
        standin,
        "POST",
        "/_standin/failures",
        {"kind": "status", "status": 502, "count": 1000, "probability": 0.2, "path": GROUPS},
    )
    async with httpx.AsyncClient(base_url=standin.url) as http:  # anonymous: 401 unless failed
        statuses = [
            (await http.get(f"/orgs/{ORG}/actions/runner-groups")).status_code for _ in range(400)
        ]
    failed = statuses.count(502)
    assert 40 <= failed <= 120, failed  # 80 expected; p(outside) < 1e-6
    assert set(statuses) == {401, 502}
    assert standin.state.failures[0].count == 1000 - failed
