"""``POST /webhooks/github``: workflow_job deliveries into the job tables.

- The body was bounded by :class:`impvm.operator.http.BodyGate` (size, how many at once).
- The signature (``X-Hub-Signature-256``, HMAC-SHA256 of the raw body, constant-time compare)
  must verify with the webhook Secret of at least one pool in webhook/hybrid mode; a missing or
  bad signature is 401 and changes nothing (GitHub docs, "Validating webhook deliveries"). Each
  distinct secret is hashed once per delivery, in a worker thread (``hashlib`` releases the GIL),
  never on the event loop that renews the leader Lease; the body is parsed there too.
- A delivery feeds only the pools whose own secret verified it, and of those only the pools whose
  credentials GitHub accepted for the installation the delivery names (``installation.id``; a
  delivery without one, from a repository or organisation webhook, only PAT pools): the job goes
  into that installation's table (:class:`impvm.scaling.jobtable.JobTables`), where it changes
  only what those pools could own and names only their runners. A ``completed`` delivery takes a
  job out of demand but never ends it for good: only GitHub's own reads do.
- A body that is not a ``workflow_job`` object GitHub would send is 400 and changes nothing.
- Other events (``ping``, ...) are accepted and ignored: 202.
- A redelivery (same ``X-GitHub-Delivery`` from the same verifiers) is 200 and changes nothing;
  job state only moves forward.
- The answer is immediate; the pools' reconciles (woken here) do the work afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping

from aiohttp import web
from prometheus_client import Counter

from impvm.api.models import PoolKey
from impvm.github.webhooks import (
    SIGNATURE_HEADER,
    IgnoredEvent,
    WebhookRejected,
    WorkflowJobEvent,
    parse_delivery,
    signature_is_valid,
)
from impvm.operator.context import OperatorContext
from impvm.operator.http import answer, body_of
from impvm.operator.metrics import note_routing
from impvm.scaling.jobs import Job, PoolScope, concerned, route

log = logging.getLogger("impvm.operator.webhooks")

UNMATCHED_JOBS = Counter(
    "impvm_jobs_unmatched_total", "Queued workflow jobs that match no pool (labels or scope)."
)

Parsed = WorkflowJobEvent | IgnoredEvent | WebhookRejected


def verify_and_parse(
    secrets: Mapping[str, list[PoolKey]], headers: Mapping[str, str], body: bytes
) -> tuple[frozenset[PoolKey], Parsed]:
    """The pools whose secret (the keys of ``secrets``, each hashed once) verified the
    delivery, and the delivery parsed (or why it was refused). CPU only: run it in a thread."""
    signature = next((v for k, v in headers.items() if k.lower() == SIGNATURE_HEADER.lower()), None)
    verified = frozenset(
        key
        for secret, keys in secrets.items()
        if signature_is_valid(secret, body, signature)
        for key in keys
    )
    try:
        return verified, parse_delivery(headers, body, bool(verified))
    except WebhookRejected as e:
        return verified, e


def eligible(
    verified: frozenset[PoolKey], installation_id: int | None, scopes: Mapping[PoolKey, PoolScope]
) -> dict[str, list[PoolKey]]:
    """The verified pools a delivery naming ``installation_id`` may feed, by the installation
    of their credentials: those GitHub accepted for that installation (None: PAT pools)."""
    out: dict[str, list[PoolKey]] = {}
    for key in sorted(verified):
        scope = scopes.get(key)
        if scope is None or scope.installation is None:
            continue  # credentials not accepted by GitHub (yet): nothing is routed to it
        if scope.installation_id != installation_id:
            continue
        out.setdefault(scope.installation, []).append(key)
    return out


class WebhookReceiver:
    """The aiohttp handler; one per operator. ``max_remembered`` bounds the ids of unmatched
    jobs already logged (each is logged and counted once)."""

    def __init__(self, ctx: OperatorContext, max_remembered: int = 10000) -> None:
        self.ctx = ctx
        self.max_remembered = max_remembered
        self._logged_unmatched: OrderedDict[tuple[str, int], None] = OrderedDict()

    def _secrets(self) -> dict[str, list[PoolKey]]:
        out: dict[str, list[PoolKey]] = {}
        for key, m in self.ctx.pools.items():
            if m.webhook_secret:
                out.setdefault(m.webhook_secret, []).append(key)
        return out

    async def handle(self, request: web.Request) -> web.Response:
        """Verify, parse and record one delivery."""
        body = await body_of(request)
        headers = dict(request.headers)
        verified, parsed = await asyncio.to_thread(verify_and_parse, self._secrets(), headers, body)
        if isinstance(parsed, WebhookRejected):
            return answer(400 if verified else 401, str(parsed))
        if isinstance(parsed, IgnoredEvent):
            return answer(202, f"ignored {parsed.event} event")
        scopes = {k: m.scope for k, m in self.ctx.pools.items() if m.scope is not None}
        groups = eligible(verified, parsed.installation_id, scopes)
        if not groups:
            log.info(
                "delivery %s for installation %s: no pool whose secret verified it has "
                "credentials GitHub accepted for that installation",
                parsed.delivery_id,
                parsed.installation_id,
            )
            return answer(200, "no pool of that installation verified it: nothing recorded")
        routing = list(scopes.values())
        origin = tuple(sorted({k.namespace for k in verified}))
        changed: list[Job] = []
        unmatched: list[Job] = []
        duplicate = True
        for installation, keys in groups.items():
            table = self.ctx.jobs.of(installation)
            if table.seen_delivery(parsed.delivery_id, origin):
                continue
            duplicate = False
            job = _job(parsed, keys, installation, self.ctx)
            new = job.id not in table.jobs
            recorded = table.apply(job, routing)
            if recorded is not None:
                changed.append(recorded)
                if new and recorded.queued:
                    note_routing(recorded, routing)
            elif new and job.queued:
                unmatched.append(job)  # none of its verifiers could run it: not recorded
        if duplicate:
            return answer(200, "duplicate delivery")
        for job in unmatched:
            self._unmatched(job)
        if not changed:
            if unmatched:
                return answer(202, f"job {parsed.job_id} matches no pool that verified it")
            return answer(200, "no change")
        for recorded in changed:
            self._wake_for(recorded, routing)
        return answer(202, f"job {parsed.job_id} {changed[0].status}")

    def _unmatched(self, job: Job) -> None:
        """Log and count a queued job no pool matches, once."""
        ident = (job.installation, job.id)
        if ident in self._logged_unmatched:
            return
        self._logged_unmatched[ident] = None
        while len(self._logged_unmatched) > self.max_remembered:
            self._logged_unmatched.popitem(last=False)
        UNMATCHED_JOBS.inc()
        log.info(
            "job %d of %s with labels %s matches no pool", job.id, job.repository, list(job.labels)
        )

    def _wake_for(self, job: Job, scopes: list[PoolScope]) -> None:
        """Wake the pools the job concerns (:func:`concerned`); a queued job that matches
        none is logged once."""
        if job.queued and route(job, scopes) is None:
            self._unmatched(job)
        for key in sorted(concerned(job, scopes)):
            self.ctx.wake(key)


def _job(
    parsed: WorkflowJobEvent, keys: list[PoolKey], installation: str, ctx: OperatorContext
) -> Job:
    return Job(
        id=parsed.job_id,
        run_id=parsed.run_id,
        repository=parsed.repository,
        labels=tuple(parsed.labels),
        status="queued" if parsed.action == "waiting" else parsed.action,
        seen_at=ctx.clock.now(),
        runner_name=parsed.runner_name,
        started_at=parsed.started_at if parsed.action != "queued" else None,
        completed_at=parsed.completed_at,
        allowed=frozenset((k.namespace, k.name) for k in keys),
        installation=installation,
    )
