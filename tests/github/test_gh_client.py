"""REST calls against the stand-in: runner groups, JIT, runners, runs/jobs, repos, ETags."""

from __future__ import annotations

import base64
import json

import pytest
from gh_support import ORG, REPO, api_requests
from pydantic import SecretStr

from impvm.devstack.standin import StandIn
from impvm.github import (
    REPO_RUNNER_GROUP_ID,
    AppCredentials,
    DeleteOutcome,
    GitHubClient,
    Scope,
)
from impvm.github.errors import Conflict, NotFound

ORG_SCOPE = Scope(org=ORG)


def test_scope_needs_exactly_one() -> None:
    with pytest.raises(ValueError):
        Scope()
    with pytest.raises(ValueError):
        Scope(org="a", repo="a/b")
    with pytest.raises(ValueError):
        Scope(repo="no-slash")


async def test_runner_group_lookup_across_pages(
    standin: StandIn, credentials: AppCredentials
) -> None:
    for i in range(6):
        standin.state.add_runner_group(ORG, f"group-{i}")
    client = GitHubClient(credentials, api_url=standin.url, page_size=2)
    wanted = next(g.id for g in standin.state.runner_groups.values() if g.name == "group-5")
    assert await client.runner_group_id(ORG, "group-5") == wanted
    assert await client.runner_group_id(ORG) == 1
    pages = api_requests(standin, "/orgs/{org}/actions/runner-groups")
    assert len(pages) >= 4  # 7 groups, 2 per page
    with pytest.raises(NotFound):
        await client.runner_group_id(ORG, "no-such-group")


async def test_jit_for_org_with_labels(standin: StandIn, client: GitHubClient) -> None:
    group = standin.state.add_runner_group(ORG, "vms")
    gid = await client.runner_group_id(ORG, "vms")
    assert gid == group.id
    jit = await client.generate_jitconfig(ORG_SCOPE, "impvm-pool-a-1", gid, ["linux", "kvm"])
    assert jit.runner_name == "impvm-pool-a-1"
    encoded = jit.encoded_jit_config.get_secret_value()
    assert encoded not in repr(jit) and encoded not in str(jit)
    runner = standin.state.runners[jit.runner_id]
    assert (runner.labels, runner.group_id, runner.org) == (["linux", "kvm"], group.id, ORG)
    decoded = json.loads(base64.b64decode(encoded))
    assert set(decoded) == {".runner", ".credentials", ".credentials_rsaparams"}
    settings = json.loads(base64.b64decode(decoded[".runner"]))
    assert settings["agentName"] == "impvm-pool-a-1"
    assert settings["serverUrl"].startswith(standin.url)
    listed = await client.list_runners(ORG_SCOPE, "impvm-pool-a-")
    assert [(r.id, r.labels, r.status, r.busy) for r in listed] == [
        (jit.runner_id, ("linux", "kvm"), "offline", False)
    ]


async def test_jit_for_repo_scope(standin: StandIn, client: GitHubClient) -> None:
    scope = Scope(repo=REPO)
    jit = await client.generate_jitconfig(scope, "repo-runner", REPO_RUNNER_GROUP_ID, ["arm64"])
    assert standin.state.runners[jit.runner_id].repo == REPO
    assert [r.name for r in await client.list_runners(scope)] == ["repo-runner"]
    assert await client.list_runners(ORG_SCOPE) == []
    got = await client.get_runner(scope, jit.runner_id)
    assert got is not None and got.labels == ("arm64",)
    assert await client.delete_runner(scope, jit.runner_id) is DeleteOutcome.DELETED


async def test_duplicate_runner_name_is_a_conflict(standin: StandIn, client: GitHubClient) -> None:
    await client.generate_jitconfig(ORG_SCOPE, "dup", 1, ["linux"])
    with pytest.raises(Conflict) as info:
        await client.generate_jitconfig(ORG_SCOPE, "dup", 1, ["linux"])
    assert info.value.status == 409
    assert len(standin.state.runners) == 1


async def test_delete_runner_busy_then_deleted_then_not_found(
    standin: StandIn, client: GitHubClient
) -> None:
    jit = await client.generate_jitconfig(ORG_SCOPE, "busy-one", 1, ["linux"])
    standin.state.runners[jit.runner_id].busy = True
    assert await client.delete_runner(ORG_SCOPE, jit.runner_id) is DeleteOutcome.BUSY
    statuses = [
        r["status"] for r in api_requests(standin, "/orgs/{org}/actions/runners/{runner_id}")
    ]
    assert statuses == [422]
    standin.state.runners[jit.runner_id].busy = False
    assert await client.delete_runner(ORG_SCOPE, jit.runner_id) is DeleteOutcome.DELETED
    assert await client.delete_runner(ORG_SCOPE, jit.runner_id) is DeleteOutcome.NOT_FOUND
    assert await client.get_runner(ORG_SCOPE, jit.runner_id) is None


async def test_list_runners_filters_prefix_across_pages(
    standin: StandIn, credentials: AppCredentials
) -> None:
    client = GitHubClient(credentials, api_url=standin.url, page_size=2)
    for i in range(5):
        await client.generate_jitconfig(ORG_SCOPE, f"pool-a-{i}", 1, ["linux"])
    await client.generate_jitconfig(ORG_SCOPE, "other-0", 1, ["linux"])
    names = [r.name for r in await client.list_runners(ORG_SCOPE, "pool-a-")]
    assert names == [f"pool-a-{i}" for i in range(5)]


async def test_runs_and_jobs(standin: StandIn, client: GitHubClient) -> None:
    job = standin.state.queue_job(REPO, ["self-hosted", "linux"], name="test")
    runs = await client.list_runs(REPO, "queued")
    assert [(r.id, r.status, r.repository) for r in runs] == [(job.run_id, "queued", REPO)]
    assert await client.list_runs(REPO, "in_progress") == []
    jobs = await client.list_run_jobs(REPO, job.run_id, "all")
    assert [(j.id, j.labels, j.status, j.runner_name) for j in jobs] == [
        (job.id, ("self-hosted", "linux"), "queued", None)
    ]
    run = await client.get_run(REPO, job.run_id)
    assert run is not None and run.status == "queued"
    got = await client.get_job(REPO, job.id)
    assert got is not None and got.name == "test"
    assert await client.get_job(REPO, 999_999) is None
    assert await client.get_run(REPO, 999_999) is None


async def test_installation_repos_and_rate_limit(standin: StandIn, client: GitHubClient) -> None:
    standin.state.add_repo(f"{ORG}/second")
    standin.state.add_repo("someone-else/private")
    repos = await client.list_installation_repos()
    assert sorted(r.full_name for r in repos) == [REPO, f"{ORG}/second"]
    limits = await client.rate_limit()
    assert limits["core"].limit == 5000
    assert 0 < limits["core"].remaining < 5000


async def test_etag_304_on_repeated_list_reads(standin: StandIn, client: GitHubClient) -> None:
    await client.generate_jitconfig(ORG_SCOPE, "etag-1", 1, ["linux"])
    first = await client.list_runners(ORG_SCOPE)
    before = (await client.rate_limit())["core"].remaining
    second = await client.list_runners(ORG_SCOPE)
    after = (await client.rate_limit())["core"].remaining
    assert first == second
    statuses = [r["status"] for r in api_requests(standin, "/orgs/{org}/actions/runners")]
    assert statuses == [200, 304]
    assert after == before  # a 304 costs no rate limit
    # A change is seen: new body, 200 again.
    await client.generate_jitconfig(ORG_SCOPE, "etag-2", 1, ["linux"])
    third = await client.list_runners(ORG_SCOPE)
    assert [r.name for r in third] == ["etag-1", "etag-2"]
    statuses = [r["status"] for r in api_requests(standin, "/orgs/{org}/actions/runners")]
    assert statuses == [200, 304, 200]


async def test_wrong_org_is_not_found(standin: StandIn, client: GitHubClient) -> None:
    standin.state.add_org("other-org")
    with pytest.raises(NotFound):
        await client.runner_group_id("other-org")
    with pytest.raises(NotFound):
        await client.runner_group_id("missing-org")


async def test_unknown_installation_is_removed(standin: StandIn, private_key: str) -> None:
    from impvm.github.errors import InstallationUnavailable

    creds = AppCredentials(4242, 999, SecretStr(private_key))
    with pytest.raises(InstallationUnavailable) as info:
        await GitHubClient(creds, api_url=standin.url).runner_group_id(ORG)
    assert info.value.reason == "removed"


async def test_metrics_use_templated_endpoints(standin: StandIn, client: GitHubClient) -> None:
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    endpoint = "/orgs/{org}/actions/runners"
    calls_before = value(
        "impvm_github_api_calls_total", endpoint=endpoint, method="GET", status="200"
    )
    mints_before = value("impvm_github_token_mints_total", result="ok")
    await client.list_runners(ORG_SCOPE)
    await client.list_runners(ORG_SCOPE)
    assert (
        value("impvm_github_api_calls_total", endpoint=endpoint, method="GET", status="200")
        == calls_before + 1
    )
    assert value("impvm_github_api_calls_total", endpoint=endpoint, method="GET", status="304") >= 1
    assert value("impvm_github_token_mints_total", result="ok") == mints_before + 1
    assert value("impvm_github_rate_limit_remaining", resource="core") > 0


async def test_every_poll_read_is_conditional_and_counts_its_304s(
    standin: StandIn, client: GitHubClient
) -> None:
    """The three reads a poll makes (installation repositories, runs by status, a run's jobs)
    send If-None-Match once they hold an ETag, and count GitHub's 304 as such; a change is a
    200 again."""
    job = standin.state.queue_job(REPO, ["self-hosted", "linux"])
    reads = {
        "/installation/repositories": client.read_installation_repos,
        "/repos/{owner}/{repo}/actions/runs": lambda: client.read_runs(REPO, "queued"),
        "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs": lambda: client.read_run_jobs(
            REPO, job.run_id
        ),
    }
    for path, read in reads.items():
        first = await read()
        second = await read()
        assert (first.calls, first.not_modified, first.unchanged) == (1, 0, False), path
        assert (second.calls, second.not_modified, second.unchanged) == (1, 1, True), path
        assert second.items == first.items, path
        log = api_requests(standin, path)
        assert [(r["status"], r["conditional"]) for r in log] == [(200, False), (304, True)]
    standin.state.queue_job(REPO, ["self-hosted", "linux"])
    changed = await client.read_runs(REPO, "queued")
    assert (changed.calls, changed.not_modified, len(changed.items)) == (1, 0, 2)


async def test_a_list_over_pages_is_unchanged_only_when_every_page_was_304(
    standin: StandIn, credentials: AppCredentials
) -> None:
    client = GitHubClient(credentials, api_url=standin.url, page_size=2)
    for i in range(5):
        standin.state.add_repo(f"{ORG}/paged-{i}")
    first = await client.read_installation_repos()
    again = await client.read_installation_repos()
    assert (first.calls, first.not_modified) == (3, 0)
    assert (again.calls, again.not_modified, again.unchanged) == (3, 3, True)
    standin.state.add_repo(f"{ORG}/paged-5")
    grown = await client.read_installation_repos()
    assert len(grown.items) == 7 and not grown.unchanged
    await client.close()
