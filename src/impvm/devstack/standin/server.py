"""The GitHub stand-in's HTTP server (aiohttp).

GitHub REST endpoints (served at ``/`` and at ``/api/v3`` like GitHub Enterprise Server):

* ``POST /app/installations/{installation_id}/access_tokens`` (App JWT, RS256 verified)
* ``GET /orgs/{org}/actions/runner-groups``
* ``POST /orgs/{org}/actions/runners/generate-jitconfig``,
  ``POST /repos/{owner}/{repo}/actions/runners/generate-jitconfig``
* ``GET /orgs/{org}/actions/runners``, ``GET|DELETE /orgs/{org}/actions/runners/{runner_id}``
  and the ``/repos/{owner}/{repo}/actions/runners`` equivalents
* ``GET /repos/{owner}/{repo}/actions/runs``, ``.../runs/{run_id}``, ``.../runs/{run_id}/jobs``,
  ``.../jobs/{job_id}``
* ``GET /installation/repositories``, ``GET /rate_limit``

Control API (tests and the embedded stack), JSON bodies:

* ``POST /_standin/seed`` (see :meth:`StandInState.seed`), ``POST /_standin/reset``
* ``POST /_standin/jobs`` ``{"repo", "labels", "name"?, "command"?, "sleep_seconds"?}``
* ``GET /_standin/jobs``, ``GET /_standin/runners``
* ``POST /_standin/failures`` (fields of :class:`Failure`), ``DELETE /_standin/failures``
* ``POST /_standin/installations/{id}`` ``{"suspended"?, "removed"?, "permissions"?}``
* ``POST /_standin/rate-limit`` ``{"identity"?, "remaining", "reset_in", "limit"?}``
* ``GET /_standin/requests`` (method, templated path, status, identity, permissions for token
  requests, runner name for JIT config requests), ``DELETE /_standin/requests``
* ``POST /_standin/webhooks`` ``{"url", "secret"}``, ``GET /_standin/deliveries``

Stand-in private runner protocol (not GitHub's broker protocol), authenticated with the session
token from the JIT config: ``POST /_standin/runner/session``, ``POST /_standin/runner/acquire``
``{"wait": s}``, ``POST /_standin/runner/jobs/{job_id}/complete`` ``{"conclusion"}``,
``DELETE /_standin/runner/session``.

This module is the app factory; the handlers live by area: :mod:`.auth` (App JWT, tokens),
:mod:`.runners` (runner groups, JIT configs, runners), :mod:`.runs` (runs and jobs),
:mod:`.limits` (rate limits, injected failures), :mod:`.middleware`, :mod:`.webhooks`,
:mod:`.runner_protocol` and :mod:`.control`, over :mod:`.common`.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from impvm.devstack.standin.auth import create_token, installation_repos
from impvm.devstack.standin.common import API_PREFIXES, STATE_KEY, TASKS_KEY
from impvm.devstack.standin.control import (
    control_deliveries,
    control_failure,
    control_failures_clear,
    control_installation,
    control_jobs,
    control_queue_job,
    control_rate_limit,
    control_requests,
    control_requests_clear,
    control_reset,
    control_runners,
    control_seed,
    control_webhook,
)
from impvm.devstack.standin.limits import rate_limit
from impvm.devstack.standin.middleware import github_middleware
from impvm.devstack.standin.runner_protocol import (
    expiry_loop,
    runner_acquire,
    runner_complete,
    runner_heartbeat,
    runner_session,
    runner_session_end,
)
from impvm.devstack.standin.runners import (
    delete_runner,
    get_runner,
    list_runner_groups,
    list_runners,
    org_jit,
    repo_jit,
)
from impvm.devstack.standin.runs import get_job, get_run, list_run_jobs, list_runs
from impvm.devstack.standin.state import StandInState


def build_app(state: StandInState) -> web.Application:
    """The aiohttp application serving ``state``."""
    app = web.Application(middlewares=[github_middleware])
    app[STATE_KEY] = state
    app[TASKS_KEY] = set()
    r = app.router
    for p in API_PREFIXES:
        r.add_post(p + "/app/installations/{installation_id}/access_tokens", create_token)
        r.add_get(p + "/orgs/{org}/actions/runner-groups", list_runner_groups)
        r.add_post(p + "/orgs/{org}/actions/runners/generate-jitconfig", org_jit)
        r.add_post(p + "/repos/{owner}/{repo}/actions/runners/generate-jitconfig", repo_jit)
        for base in ("/orgs/{org}", "/repos/{owner}/{repo}"):
            r.add_get(p + base + "/actions/runners", list_runners)
            r.add_get(p + base + "/actions/runners/{runner_id}", get_runner)
            r.add_delete(p + base + "/actions/runners/{runner_id}", delete_runner)
        r.add_get(p + "/repos/{owner}/{repo}/actions/runs", list_runs)
        r.add_get(p + "/repos/{owner}/{repo}/actions/runs/{run_id}", get_run)
        r.add_get(p + "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs", list_run_jobs)
        r.add_get(p + "/repos/{owner}/{repo}/actions/jobs/{job_id}", get_job)
        r.add_get(p + "/installation/repositories", installation_repos)
        r.add_get(p + "/rate_limit", rate_limit)
    r.add_post("/_standin/seed", control_seed)
    r.add_post("/_standin/reset", control_reset)
    r.add_post("/_standin/jobs", control_queue_job)
    r.add_get("/_standin/jobs", control_jobs)
    r.add_get("/_standin/runners", control_runners)
    r.add_post("/_standin/failures", control_failure)
    r.add_delete("/_standin/failures", control_failures_clear)
    r.add_post("/_standin/installations/{id}", control_installation)
    r.add_post("/_standin/rate-limit", control_rate_limit)
    r.add_get("/_standin/requests", control_requests)
    r.add_delete("/_standin/requests", control_requests_clear)
    r.add_post("/_standin/webhooks", control_webhook)
    r.add_get("/_standin/deliveries", control_deliveries)
    r.add_post("/_standin/runner/session", runner_session)
    r.add_delete("/_standin/runner/session", runner_session_end)
    r.add_post("/_standin/runner/acquire", runner_acquire)
    r.add_post("/_standin/runner/jobs/{job_id}/complete", runner_complete)
    r.add_post("/_standin/runner/heartbeat", runner_heartbeat)

    async def _start_expiry(app: web.Application) -> None:
        app[TASKS_KEY].add(asyncio.get_running_loop().create_task(expiry_loop(app)))

    async def _cancel_tasks(app: web.Application) -> None:
        tasks: set[asyncio.Task[None]] = app[TASKS_KEY]
        for task in list(tasks):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    app.on_startup.append(_start_expiry)
    app.on_shutdown.append(_cancel_tasks)
    return app
