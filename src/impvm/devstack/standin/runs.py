"""The GitHub stand-in's workflow run and job routes (``/repos/{owner}/{repo}/actions/runs``,
``.../runs/{run_id}``, ``.../runs/{run_id}/jobs``, ``.../jobs/{job_id}``)."""

from __future__ import annotations

from aiohttp import web

from impvm.devstack.standin.auth import require
from impvm.devstack.standin.common import ApiError, paged, repo_of, state_of


def _repo_read(request: web.Request) -> str:
    repo = repo_of(request)
    require(request, "actions", "read", repo.split("/")[0])
    return repo


async def list_runs(request: web.Request) -> web.Response:
    state = state_of(request)
    repo = _repo_read(request)
    status = request.query.get("status")
    runs = [
        state.workflow_run(r)
        for r in sorted(state.runs.values(), key=lambda r: -r.id)
        if r.repo == repo and (status is None or status in (r.status, r.conclusion))
    ]
    return paged(request, runs, "workflow_runs")


async def get_run(request: web.Request) -> web.Response:
    state = state_of(request)
    repo = _repo_read(request)
    run = state.runs.get(int(request.match_info["run_id"]))
    if run is None or run.repo != repo:
        raise ApiError(404, "Not Found")
    return web.json_response(state.workflow_run(run))


async def list_run_jobs(request: web.Request) -> web.Response:
    state = state_of(request)
    repo = _repo_read(request)
    run = state.runs.get(int(request.match_info["run_id"]))
    if run is None or run.repo != repo:
        raise ApiError(404, "Not Found")
    if request.query.get("filter", "latest") not in ("latest", "all"):
        raise ApiError(422, "Invalid filter")
    jobs = [
        state.job(j) for j in sorted(state.jobs.values(), key=lambda j: j.id) if j.run_id == run.id
    ]
    return paged(request, jobs, "jobs")


async def get_job(request: web.Request) -> web.Response:
    state = state_of(request)
    repo = _repo_read(request)
    job = state.jobs.get(int(request.match_info["job_id"]))
    if job is None or job.repo != repo:
        raise ApiError(404, "Not Found")
    return web.json_response(state.job(job))
