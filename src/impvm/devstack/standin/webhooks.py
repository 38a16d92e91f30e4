"""The GitHub stand-in's webhook delivery: signed ``workflow_job`` events to every registered
target (some dropped on purpose), each delivery recorded."""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import aiohttp
from aiohttp import web

from impvm.devstack.standin.common import STATE_KEY, TASKS_KEY
from impvm.devstack.standin.records import Delivery, JobRec, WebhookTarget
from impvm.devstack.standin.state import StandInState
from impvm.github.webhooks import compute_signature


def _installation_for(state: StandInState, repo: str) -> int | None:
    owner = repo.split("/")[0]
    for inst in state.installations.values():
        if inst.account == owner and not inst.removed:
            return inst.id
    return None


def emit_workflow_job(app: web.Application, action: str, job: JobRec) -> None:
    """Deliver a signed ``workflow_job`` webhook to every registered target (asynchronously)."""
    state = app[STATE_KEY]
    if not state.webhooks:
        return
    installation = _installation_for(state, job.repo)
    payload = state.workflow_job_payload(action, job, installation)
    body = json.dumps(payload).encode()
    inst = state.installations.get(installation) if installation is not None else None
    for target in list(state.webhooks):
        if target.app_id is not None and (inst is None or inst.app_id != target.app_id):
            continue  # not this App's installation: its webhook never hears of the job
        if target.drop_rate and random.random() < target.drop_rate:
            state.deliveries.append(
                Delivery(str(uuid.uuid4()), "workflow_job", action, None, error="dropped")
            )
            continue
        task = asyncio.get_running_loop().create_task(_deliver(state, target, action, body))
        app[TASKS_KEY].add(task)
        task.add_done_callback(app[TASKS_KEY].discard)


async def _deliver(state: StandInState, target: WebhookTarget, action: str, body: bytes) -> None:
    delivery = Delivery(str(uuid.uuid4()), "workflow_job", action, None)
    state.deliveries.append(delivery)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/standin",
        "X-GitHub-Event": "workflow_job",
        "X-GitHub-Delivery": delivery.id,
        "X-GitHub-Hook-ID": "1",
        "X-Hub-Signature-256": compute_signature(target.secret, body),
    }
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(target.url, data=body, headers=headers) as resp,
        ):
            delivery.status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        delivery.error = type(exc).__name__
