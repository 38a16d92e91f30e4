"""The stand-in's private runner protocol (not GitHub's broker protocol), authenticated with
the session token of the JIT config: session, heartbeat, acquire a job, complete it; and the
expiry of runners that fell silent."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from impvm.devstack.standin.common import STATE_KEY, state_of
from impvm.devstack.standin.records import RunnerRec
from impvm.devstack.standin.webhooks import emit_workflow_job


def _session_runner(request: web.Request) -> RunnerRec:
    state = state_of(request)
    _, _, token = request.headers.get("Authorization", "").partition(" ")
    for runner in state.runners.values():
        if token and runner.session_token == token:
            runner.last_seen = time.time()
            return runner
    raise web.HTTPUnauthorized(text="unknown runner session")


async def runner_heartbeat(request: web.Request) -> web.Response:
    runner = _session_runner(request)
    if runner.status != "online":
        raise web.HTTPConflict(text="runner is offline")
    return web.Response(status=204)


def expire_runners(app: web.Application, now: float) -> None:
    """Runners silent for ``runner_timeout`` go offline; a job one was running fails (a runner
    that died mid-job: GitHub fails the job and shows the runner offline)."""
    state = app[STATE_KEY]
    for runner in list(state.runners.values()):
        if runner.status != "online" or not runner.last_seen:
            continue  # offline, or put online by a test without a session: not tracked
        if now - runner.last_seen < state.runner_timeout:
            continue
        runner.status = "offline"
        job = state.jobs.get(runner.job_id) if runner.job_id is not None else None
        if runner.busy and job is not None and job.status == "in_progress":
            job.status = "completed"
            job.conclusion = "failure"
            job.completed_at = now
            state.sync_run(job.run_id)
            emit_workflow_job(app, "completed", job)
        runner.busy = False


async def expiry_loop(app: web.Application) -> None:
    while True:
        await asyncio.sleep(1.0)
        expire_runners(app, time.time())


async def runner_session(request: web.Request) -> web.Response:
    runner = _session_runner(request)
    runner.status = "online"
    return web.json_response({"runner_id": runner.id, "runner_name": runner.name})


async def runner_session_end(request: web.Request) -> web.Response:
    state = state_of(request)
    runner = _session_runner(request)
    runner.status = "offline"
    if runner.ephemeral and runner.job_id is not None and not runner.busy:
        state.runners.pop(runner.id, None)
    return web.Response(status=204)


async def runner_acquire(request: web.Request) -> web.Response:
    state = state_of(request)
    runner = _session_runner(request)
    body = await request.json() if request.can_read_body else {}
    deadline = time.monotonic() + float(body.get("wait", 0))
    if runner.job_id is not None:
        return web.json_response({"error": "ephemeral runner already took a job"}, status=409)
    while True:
        if state.runners.get(runner.id) is not runner:
            # deregistered during the long poll: GitHub hands it no job (its session is gone)
            raise web.HTTPNotFound(text="runner registration was deleted")
        runner.last_seen = time.time()  # a long poll is contact
        for job in sorted(state.jobs.values(), key=lambda j: j.id):
            if job.status == "queued" and state.runner_can_take(runner, job):
                group = state.runner_groups.get(runner.group_id)
                job.status = "in_progress"
                job.started_at = time.time()
                job.runner_id = runner.id
                job.runner_name = runner.name
                job.runner_group_id = runner.group_id
                job.runner_group_name = group.name if group else "Default"
                runner.busy = True
                runner.job_id = job.id
                state.sync_run(job.run_id)
                emit_workflow_job(request.app, "in_progress", job)
                spec = {
                    "id": job.id,
                    "labels": job.labels,
                    "command": job.command,
                    "sleep_seconds": job.sleep_seconds,
                    "repository": job.repo,
                }
                return web.json_response({"job": spec})
        if time.monotonic() >= deadline:
            return web.Response(status=204)
        await asyncio.sleep(0.1)


async def runner_complete(request: web.Request) -> web.Response:
    state = state_of(request)
    runner = _session_runner(request)
    job = state.jobs.get(int(request.match_info["job_id"]))
    if job is None or job.runner_id != runner.id:
        raise web.HTTPNotFound(text="job not assigned to this runner")
    body = await request.json() if request.can_read_body else {}
    job.status = "completed"
    job.conclusion = str(body.get("conclusion", "success"))
    job.completed_at = time.time()
    runner.busy = False
    state.sync_run(job.run_id)
    emit_workflow_job(request.app, "completed", job)
    return web.json_response({"ok": True})
