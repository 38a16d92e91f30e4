"""The GitHub stand-in's control API under ``/_standin`` (tests and the embedded stack): seed
and reset, queue jobs, list jobs and runners, inject failures, change installations and rate
limits, read the request log, register webhooks and read their deliveries."""

from __future__ import annotations

import time
from dataclasses import asdict, fields

from aiohttp import web

from impvm.devstack.standin.common import state_of
from impvm.devstack.standin.limits import bucket_for
from impvm.devstack.standin.records import Failure, Installation, WebhookTarget
from impvm.devstack.standin.state import StandInState
from impvm.devstack.standin.webhooks import emit_workflow_job


async def control_seed(request: web.Request) -> web.Response:
    state_of(request).seed(await request.json())
    return web.json_response({"ok": True})


async def control_reset(request: web.Request) -> web.Response:
    state = state_of(request)
    fresh = StandInState(base_url=state.base_url)
    for f in fields(StandInState):
        setattr(state, f.name, getattr(fresh, f.name))
    return web.json_response({"ok": True})


async def control_queue_job(request: web.Request) -> web.Response:
    body = await request.json()
    job = state_of(request).queue_job(
        body["repo"],
        body.get("labels", ["self-hosted"]),
        name=body.get("name", "build"),
        workflow_name=body.get("workflow_name", "CI"),
        command=body.get("command"),
        sleep_seconds=float(body.get("sleep_seconds", 0)),
    )
    emit_workflow_job(request.app, "queued", job)
    return web.json_response({"job_id": job.id, "run_id": job.run_id}, status=201)


async def control_jobs(request: web.Request) -> web.Response:
    state = state_of(request)
    return web.json_response([state.job(j) for j in state.jobs.values()])


async def control_runners(request: web.Request) -> web.Response:
    state = state_of(request)
    out = [{**state.runner(r), "org": r.org, "repo": r.repo} for r in state.runners.values()]
    return web.json_response(out)


async def control_failure(request: web.Request) -> web.Response:
    body = await request.json()
    known = {f.name for f in fields(Failure)}
    state_of(request).failures.append(Failure(**{k: v for k, v in body.items() if k in known}))
    return web.json_response({"ok": True}, status=201)


async def control_failures_clear(request: web.Request) -> web.Response:
    state_of(request).failures.clear()
    return web.Response(status=204)


async def control_installation(request: web.Request) -> web.Response:
    state = state_of(request)
    inst: Installation | None = state.installations.get(int(request.match_info["id"]))
    if inst is None:
        raise web.HTTPNotFound()
    body = await request.json()
    inst.suspended = bool(body.get("suspended", inst.suspended))
    inst.removed = bool(body.get("removed", inst.removed))
    if "permissions" in body:
        inst.permissions = dict(body["permissions"])
    return web.json_response({"ok": True})


async def control_rate_limit(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await request.json()
    identities = [body["identity"]] if body.get("identity") else None
    if identities is None:
        identities = [f"installation:{i}" for i in state.installations]
        identities += [f"pat:{p.account}" for p in state.pats.values()]
    for identity in identities:
        bucket = bucket_for(state, identity)
        bucket.limit = int(body.get("limit", bucket.limit))
        bucket.remaining = int(body["remaining"])
        bucket.reset = time.time() + float(body.get("reset_in", 3600))
    return web.json_response({"ok": True})


async def control_requests(request: web.Request) -> web.Response:
    return web.json_response(state_of(request).requests)


async def control_requests_clear(request: web.Request) -> web.Response:
    state_of(request).requests.clear()
    return web.Response(status=204)


async def control_webhook(request: web.Request) -> web.Response:
    body = await request.json()
    state_of(request).webhooks.append(
        WebhookTarget(body["url"], body["secret"], float(body.get("drop_rate", 0.0)))
    )
    return web.json_response({"ok": True}, status=201)


async def control_deliveries(request: web.Request) -> web.Response:
    return web.json_response([asdict(d) for d in state_of(request).deliveries])
