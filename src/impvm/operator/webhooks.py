"""``POST /webhooks/github``: workflow_job deliveries into the job table.

- The signature (``X-Hub-Signature-256``, HMAC-SHA256 of the raw body, constant-time compare)
  must verify with the webhook Secret of at least one pool in webhook/hybrid mode; a missing or
  bad signature is 401 and changes nothing (GitHub docs, "Validating webhook deliveries").
  A delivery feeds only the pools whose own secret verified it.
- A body that is not a ``workflow_job`` object GitHub would send is 400 and changes nothing.
- Other events (``ping``, ...) are accepted and ignored: 202.
- A redelivery (same ``X-GitHub-Delivery``) is 200 and changes nothing; job state only moves
  forward (:class:`impvm.scaling.jobtable.JobTable`).
- The answer is immediate; the pools' reconciles (woken here) do the work afterwards.

Verification and parsing are :func:`impvm.github.webhooks.handle_delivery` (which also counts
``impvm_github_webhook_deliveries_total``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from aiohttp import web
from prometheus_client import Counter

from impvm.github.webhooks import (
    SIGNATURE_HEADER,
    IgnoredEvent,
    WebhookRejected,
    handle_delivery,
    signature_is_valid,
)
from impvm.operator.context import OperatorContext
from impvm.scaling.jobtable import Job, route
from impvm.scaling.names import owns_runner_name

log = logging.getLogger("impvm.operator.webhooks")

UNMATCHED_JOBS = Counter(
    "impvm_jobs_unmatched_total", "Queued workflow jobs that match no pool (labels or scope)."
)
WEBHOOK_RESULTS = Counter(
    "impvm_webhook_requests_total", "Webhook requests by HTTP status answered.", ["status"]
)


class WebhookReceiver:
    """The aiohttp handler; one per operator. ``max_remembered`` bounds the ids of unmatched
    jobs already logged (each is logged and counted once)."""

    def __init__(self, ctx: OperatorContext, max_remembered: int = 10000) -> None:
        self.ctx = ctx
        self.max_remembered = max_remembered
        self._logged_unmatched: OrderedDict[int, None] = OrderedDict()

    def _answer(self, status: int, message: str) -> web.Response:
        WEBHOOK_RESULTS.labels(status=str(status)).inc()
        return web.json_response({"message": message}, status=status)

    async def handle(self, request: web.Request) -> web.Response:
        """Verify, parse and record one delivery."""
        body = await request.read()
        signature = request.headers.get(SIGNATURE_HEADER)
        secrets = {
            key: m.webhook_secret
            for key, m in self.ctx.pools.items()
            if m.webhook_secret and signature_is_valid(m.webhook_secret, body, signature)
        }
        verified = frozenset(secrets)
        try:
            parsed = handle_delivery(next(iter(secrets.values()), None), request.headers, body)
        except WebhookRejected as e:
            return self._answer(400 if verified else 401, str(e))
        if isinstance(parsed, IgnoredEvent):
            return self._answer(202, f"ignored {parsed.event} event")
        if self.ctx.jobs.seen_delivery(parsed.delivery_id):
            return self._answer(200, "duplicate delivery")
        job = Job(
            id=parsed.job_id,
            run_id=parsed.run_id,
            repository=parsed.repository,
            labels=tuple(parsed.labels),
            status="queued" if parsed.action == "waiting" else parsed.action,
            seen_at=self.ctx.clock.now(),
            runner_name=parsed.runner_name,
            started_at=parsed.started_at if parsed.action != "queued" else None,
            completed_at=parsed.completed_at,
            allowed=frozenset((k.namespace, k.name) for k in verified),
        )
        recorded = self.ctx.jobs.apply(job)
        if recorded is None:
            return self._answer(200, "no change")
        self._wake_for(recorded)
        return self._answer(202, f"job {job.id} {job.status}")

    def _wake_for(self, job: Job) -> None:
        """Wake the pool the job belongs to; a job that matches none is logged once."""
        pool = route(job, self.ctx.scopes())
        if pool is not None:
            self.ctx.wake(pool.key)
            return
        if job.queued and job.id not in self._logged_unmatched:
            self._logged_unmatched[job.id] = None
            while len(self._logged_unmatched) > self.max_remembered:
                self._logged_unmatched.popitem(last=False)
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
                if mem.prefix and owns_runner_name(mem.prefix, job.runner_name):
                    self.ctx.wake(key)
