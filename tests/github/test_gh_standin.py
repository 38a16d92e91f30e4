"""The stand-in itself: GitHub's schemas, the stand-in runner, webhook deliveries, serve()."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from typing import Any

import githubkit_schemas.latest.models as gm
import httpx
import pytest
from aiohttp import web
from gh_support import APP_ID, INSTALLATION_ID, ORG, REPO, control, webhook_examples
from githubkit.compat import type_validate_python
from githubkit.webhooks import parse_obj

from impvm.devstack.standin import StandIn
from impvm.github import GitHubClient, Scope, create_app_jwt
from impvm.github.webhooks import WorkflowJobEvent, handle_delivery


async def _token(standin: StandIn, private_key: str) -> str:
    jwt_ = create_app_jwt(APP_ID, private_key)
    async with httpx.AsyncClient(base_url=standin.url) as http:
        resp = await http.post(
            f"/app/installations/{INSTALLATION_ID}/access_tokens",
            headers={"Authorization": f"Bearer {jwt_}"},
        )
    assert resp.status_code == 201
    token = type_validate_python(gm.InstallationToken, resp.json())
    return token.token


async def test_responses_match_github_schemas(standin: StandIn, private_key: str) -> None:
    """Every GitHub-shaped response parses with githubkit's models of GitHub's OpenAPI."""
    token = await _token(standin, private_key)
    job = standin.state.queue_job(REPO, ["linux"])
    owner, name = REPO.split("/")
    async with httpx.AsyncClient(
        base_url=standin.url, headers={"Authorization": f"token {token}"}
    ) as http:

        async def check(method: str, path: str, model: Any, status: int, body: Any = None) -> Any:
            resp = await http.request(method, path, json=body)
            assert resp.status_code == status, resp.text
            return type_validate_python(model, resp.json())

        jit = await check(
            "POST",
            f"/orgs/{ORG}/actions/runners/generate-jitconfig",
            gm.OrgsOrgActionsRunnersGenerateJitconfigPostResponse201,
            201,
            {"name": "schema-1", "runner_group_id": 1, "labels": ["linux"]},
        )
        await check(
            "POST",
            f"/repos/{REPO}/actions/runners/generate-jitconfig",
            gm.OrgsOrgActionsRunnersGenerateJitconfigPostResponse201,
            201,
            {"name": "schema-2", "runner_group_id": 1, "labels": ["linux"]},
        )
        rid = jit.runner.id
        await check(
            "GET",
            f"/orgs/{ORG}/actions/runner-groups",
            gm.OrgsOrgActionsRunnerGroupsGetResponse200,
            200,
        )
        await check(
            "GET", f"/orgs/{ORG}/actions/runners", gm.OrgsOrgActionsRunnersGetResponse200, 200
        )
        await check(
            "GET",
            f"/repos/{REPO}/actions/runners",
            gm.ReposOwnerRepoActionsRunnersGetResponse200,
            200,
        )
        await check("GET", f"/orgs/{ORG}/actions/runners/{rid}", gm.Runner, 200)
        await check(
            "GET",
            f"/repos/{owner}/{name}/actions/runs",
            gm.ReposOwnerRepoActionsRunsGetResponse200,
            200,
        )
        await check("GET", f"/repos/{REPO}/actions/runs/{job.run_id}", gm.WorkflowRun, 200)
        await check(
            "GET",
            f"/repos/{REPO}/actions/runs/{job.run_id}/jobs",
            gm.ReposOwnerRepoActionsRunsRunIdJobsGetResponse200,
            200,
        )
        await check("GET", f"/repos/{REPO}/actions/jobs/{job.id}", gm.Job, 200)
        await check(
            "GET", "/installation/repositories", gm.InstallationRepositoriesGetResponse200, 200
        )
        await check("GET", "/rate_limit", gm.RateLimitOverview, 200)
        # Error shapes.
        await check(
            "POST",
            f"/orgs/{ORG}/actions/runners/generate-jitconfig",
            gm.BasicError,
            409,
            {"name": "schema-1", "runner_group_id": 1, "labels": ["linux"]},
        )
        await check(
            "POST",
            f"/orgs/{ORG}/actions/runners/generate-jitconfig",
            gm.ValidationErrorSimple,
            422,
            {"name": "schema-3", "runner_group_id": 1, "labels": []},
        )
        await check("GET", f"/orgs/{ORG}/actions/runners/999999", gm.BasicError, 404)
        resp = await http.get("/rate_limit")
        for header in (
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
            "x-ratelimit-used",
            "x-ratelimit-resource",
        ):
            assert header in resp.headers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_standin_runner_takes_one_job_and_webhooks_are_delivered(
    standin: StandIn, client: GitHubClient
) -> None:
    """JIT -> stand-in runner online -> takes the matching job -> completes -> exits 0;
    signed workflow_job webhooks (queued, in_progress, completed) match GitHub's schema."""
    received: list[tuple[dict[str, str], bytes]] = []

    async def hook(request: web.Request) -> web.Response:
        received.append((dict(request.headers), await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/webhooks/github", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await control(
            standin,
            "POST",
            "/_standin/webhooks",
            {"url": f"http://127.0.0.1:{port}/webhooks/github", "secret": "hooksecret"},
        )
        other = await control(
            standin, "POST", "/_standin/jobs", {"repo": REPO, "labels": ["self-hosted", "gpu"]}
        )
        queued = await control(
            standin,
            "POST",
            "/_standin/jobs",
            {"repo": REPO, "labels": ["self-hosted", "linux"], "sleep_seconds": 0.2},
        )
        jit = await client.generate_jitconfig(Scope(org=ORG), "vm-runner-1", 1, ["linux"])
        env = dict(
            os.environ,
            ACTIONS_RUNNER_INPUT_JITCONFIG=jit.encoded_jit_config.get_secret_value(),
            IMPVM_STANDIN_RUNNER_IDLE_TIMEOUT="20",
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
        assert proc.returncode == 0, out
        assert jit.encoded_jit_config.get_secret_value().encode() not in out
        job = await client.get_job(REPO, queued["job_id"])
        assert job is not None
        assert (job.status, job.conclusion, job.runner_name) == (
            "completed",
            "success",
            "vm-runner-1",
        )
        untouched = await client.get_job(REPO, other["job_id"])
        assert untouched is not None and untouched.status == "queued"
        run = await client.get_run(REPO, queued["run_id"])
        assert run is not None and run.status == "completed"
        # Ephemeral: GitHub removes the registration after its one job.
        assert await client.get_runner(Scope(org=ORG), jit.runner_id) is None
        for _ in range(50):
            if len(received) >= 4:
                break
            await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
    actions = []
    for headers, body in received:
        event = handle_delivery("hooksecret", headers, body)
        assert isinstance(event, WorkflowJobEvent)
        parse_obj("workflow_job", json.loads(body))  # GitHub's current schema
        actions.append((event.job_id, event.action, event.runner_name))
    assert sorted(
        actions, key=lambda a: (a[0], ["queued", "in_progress", "completed"].index(a[1]))
    ) == [
        (other["job_id"], "queued", None),
        (queued["job_id"], "queued", None),
        (queued["job_id"], "in_progress", "vm-runner-1"),
        (queued["job_id"], "completed", "vm-runner-1"),
    ]


async def test_webhook_payload_keys_follow_octokit_examples(standin: StandIn) -> None:
    job = standin.state.queue_job(REPO, ["linux"])
    payload = standin.state.workflow_job_payload("queued", job, INSTALLATION_ID)
    (example,) = [e for e in webhook_examples() if e["action"] == "queued"][:1]
    assert set(example) <= set(payload)
    assert set(example["workflow_job"]) <= set(payload["workflow_job"])
    missing_repo_keys = set(example["repository"]) - set(payload["repository"])
    assert not missing_repo_keys, missing_repo_keys


def test_serve_runs_the_cli_entry(tmp_path: Any) -> None:
    """``python -c serve(...)`` answers GitHub routes and the control API."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from impvm.devstack.standin import serve; serve('127.0.0.1', {port})",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(100):
            try:
                resp = httpx.post(
                    f"http://127.0.0.1:{port}/_standin/seed", json={"orgs": [ORG]}, timeout=1
                )
                break
            except httpx.TransportError:
                import time

                time.sleep(0.1)
        else:
            pytest.fail("stand-in did not start")
        assert resp.status_code == 200
        unauth = httpx.get(f"http://127.0.0.1:{port}/orgs/{ORG}/actions/runner-groups")
        assert unauth.status_code == 401
        log = httpx.get(f"http://127.0.0.1:{port}/_standin/requests").json()
        assert [(r["method"], r["path"], r["status"]) for r in log] == [
            ("GET", "/orgs/{org}/actions/runner-groups", 401)
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_a_runner_that_goes_silent_mid_job_goes_offline_and_its_job_fails() -> None:
    """A runner process that dies mid-job stops heart-beating: after ``runner_timeout`` the
    stand-in shows it offline and fails its job (as GitHub does), so nothing stays busy."""
    import asyncio

    import httpx as _httpx

    from impvm.devstack.standin import StandIn
    from impvm.devstack.standin.records import RunnerRec

    s = StandIn()
    await s.start()
    try:
        st = s.state
        st.runner_timeout = 1.0
        st.add_org("o")
        st.add_repo("o/app")
        rec = RunnerRec(
            id=st.next_id(),
            name="r1",
            labels=["imp"],
            group_id=1,
            org="o",
            repo=None,
            session_token="sess_test",
            work_folder="_work",
        )
        st.runners[rec.id] = rec
        job = st.queue_job("o/app", ["self-hosted", "imp"], sleep_seconds=60)
        base = f"{s.url}/_standin/runner"
        h = {"Authorization": "Bearer sess_test"}
        async with _httpx.AsyncClient(headers=h) as http:
            (await http.post(f"{base}/session")).raise_for_status()
            got = await http.post(f"{base}/acquire", json={"wait": 1})
            assert got.status_code == 200 and got.json()["job"]["id"] == job.id
            assert rec.busy and job.status == "in_progress"
            (await http.post(f"{base}/heartbeat")).raise_for_status()
        # the runner now "dies": no heartbeat
        for _ in range(40):
            await asyncio.sleep(0.1)
            if rec.status == "offline":
                break
        assert rec.status == "offline" and not rec.busy
        assert (job.status, job.conclusion) == ("completed", "failure")
    finally:
        await s.stop()


async def test_runner_names_longer_than_64_are_refused(client: GitHubClient) -> None:
    """GitHub caps runner names at 64 characters and answers 422 to a longer JIT request."""
    from impvm.github.errors import RequestRejected

    ok = await client.generate_jitconfig(Scope(org=ORG), "n" * 64, 1, ["linux"])
    assert ok.runner_name == "n" * 64
    with pytest.raises(RequestRejected) as info:
        await client.generate_jitconfig(Scope(org=ORG), "n" * 65, 1, ["linux"])
    assert info.value.status == 422 and "64" in str(info.value)


async def test_no_job_for_a_runner_deleted_during_its_long_poll(
    standin: StandIn, client: GitHubClient
) -> None:
    """A runner deregistered while it waits for a job is handed none (GitHub does not): a
    scale-down racing a job must not pass because the stand-in is kinder than GitHub."""
    from impvm.devstack.standin_runner import decode_jitconfig

    scope = Scope(org=ORG)
    jit = await client.generate_jitconfig(scope, "doomed", 1, ["imp"])
    settings, token = decode_jitconfig(jit.encoded_jit_config.get_secret_value())
    base = str(settings["serverUrl"]).rstrip("/")
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        (await http.post(f"{base}/session")).raise_for_status()
        waiting = asyncio.create_task(http.post(f"{base}/acquire", json={"wait": 3}))
        await asyncio.sleep(0.3)
        assert (await client.delete_runner(scope, jit.runner_id)).value == "deleted"
        job = standin.state.queue_job(REPO, ["self-hosted", "imp"])
        got = await waiting
    assert got.status_code == 404
    assert job.status == "queued" and job.runner_id is None
