"""``POST /webhooks/github``: workflow_job deliveries into the job table (issue 6).

- The signature (``X-Hub-Signature-256``, HMAC-SHA256 of the raw body, constant-time compare)
  must verify with the webhook Secret of at least one pool in webhook/hybrid mode; a missing or
  bad signature is 401 and changes nothing (GitHub docs, "Validating webhook deliveries").
- A body that is not a ``workflow_job`` object GitHub would send is 400 and changes nothing.
- Other events (``ping``, ...) are accepted and ignored: 202.
- A redelivery (same ``X-GitHub-Delivery``) is 200 and changes nothing; job state only moves
  forward (:class:`impvm.scaling.jobtable.JobTable`).
- The answer is immediate; the pools' reconciles (woken here) do the work afterwards.
"""

from __future__ import annotations

import datetime as dt
import json
import logging

from aiohttp import web
from prometheus_client import Counter

from impvm.github.webhooks import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    IgnoredEvent,
    WebhookRejected,
    parse_event,
    signature_is_valid,
)
from impvm.operator.context import OperatorContext
from impvm.scaling.jobtable import Job, route

log = logging.getLogger("impvm.operator.webhooks")

UNMATCHED_JOBS = Counter(
    "impvm_jobs_unmatched_total", "Queued workflow jobs that match no pool (labels or scope)."
)
WEBHOOK_RESULTS = Counter(
    "impvm_webhook_requests_total", "Webhook requests by HTTP status answered.", ["status"]
)


class WebhookReceiver:
    """The aiohttp handler; one per operator."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx
        self._logged_unmatched: set[int] = set()

    def _answer(self, status: int, message: str) -> web.Response:
        WEBHOOK_RESULTS.labels(status=str(status)).inc()
        return web.json_response({"message": message}, status=status)

    async def handle(self, request: web.Request) -> web.Response:
        """Verify, parse and record one delivery."""
        body = await request.read()
        signature = request.headers.get(SIGNATURE_HEADER)
        # a delivery feeds only the pools whose own webhook secret verifies it: one namespace's
        # secret cannot create demand for another namespace's pools
        verified = frozenset(
            key
            for key, m in self.ctx.pools.items()
            if m.webhook_secret
            and signature
            and signature_is_valid(m.webhook_secret, body, signature)
        )
        if not verified:
            return self._answer(401, "signature missing or invalid")
        event = request.headers.get(EVENT_HEADER, "")
        if not event:
            return self._answer(400, f"missing {EVENT_HEADER} header")
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
            payload = None
        if not isinstance(payload, dict):
            return self._answer(400, "body is not a JSON object")
        delivery = request.headers.get(DELIVERY_HEADER)
        try:
            parsed = parse_event(event, payload, delivery)
        except WebhookRejected as e:
            return self._answer(400, str(e))
        if isinstance(parsed, IgnoredEvent):
            return self._answer(202, f"ignored {parsed.event} event")
        if self.ctx.jobs.seen_delivery(delivery):
            return self._answer(200, "duplicate delivery")
        now = dt.datetime.now(dt.UTC)
        job = Job(
            id=parsed.job_id,
            run_id=parsed.run_id,
            repository=parsed.repository,
            labels=tuple(parsed.labels),
            status="queued" if parsed.action == "waiting" else parsed.action,
            seen_at=now,
            runner_name=parsed.runner_name,
            started_at=parsed.started_at if parsed.action != "queued" else None,
            completed_at=parsed.completed_at,
            allowed=verified,
        )
        recorded = self.ctx.jobs.apply(job)
        if recorded is None:
            return self._answer(200, "no change")
        self._wake_for(recorded)
        return self._answer(202, f"job {job.id} {job.status}")

    def _wake_for(self, job: Job) -> None:
        scopes = self.ctx.scopes()
        pool = route(job, scopes)
        if pool is None:
            if job.queued and job.id not in self._logged_unmatched:
                self._logged_unmatched.add(job.id)
                UNMATCHED_JOBS.inc()
                log.info(
                    "job %d of %s with labels %s matches no pool",
                    job.id,
                    job.repository,
                    list(job.labels),
                )
            # a job in progress on one of our runners still matters to its pool
            if job.runner_name:
                for key, mem in self.ctx.pools.items():
                    if mem.scope and job.runner_name.startswith(key[1] + "-"):
                        self.ctx.wake(key)
            return
        self.ctx.wake((pool.namespace, pool.name))
