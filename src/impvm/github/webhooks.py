"""Webhook verification and ``workflow_job`` parsing.

Source: GitHub docs "Validating webhook deliveries" (``X-Hub-Signature-256`` is
``sha256=`` + hex HMAC-SHA256 of the raw body keyed with the webhook secret; compare in constant
time) and "Webhook events and payloads", ``workflow_job`` (actions ``queued``, ``waiting``,
``in_progress``, ``completed``).

The parser is deliberately tolerant of fields GitHub added over time (older deliveries, such as
the ``@octokit/webhooks-examples`` payloads, lack ``created_at``/``run_attempt``/...), and strict
about what the operator relies on (job id, run id, labels, status, repository).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from impvm.github import metrics

SIGNATURE_HEADER = "X-Hub-Signature-256"
EVENT_HEADER = "X-GitHub-Event"
DELIVERY_HEADER = "X-GitHub-Delivery"

WorkflowJobAction = Literal["queued", "waiting", "in_progress", "completed"]


class WebhookRejected(Exception):
    """The delivery must be refused (HTTP 401/400): missing secret, missing or wrong signature,
    or an unparsable body. The message never contains the secret or the body."""


def compute_signature(secret: str | bytes, body: bytes) -> str:
    """``sha256=<hex HMAC-SHA256(secret, body)>`` as GitHub sends in ``X-Hub-Signature-256``."""
    key = secret.encode() if isinstance(secret, str) else secret
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


def signature_is_valid(secret: str | bytes | None, body: bytes, signature: str | None) -> bool:
    """True only if ``secret`` and ``signature`` are both non-empty and ``signature`` equals
    :func:`compute_signature` (constant-time compare). A missing secret or signature is never a
    pass."""
    if not secret or not signature or not signature.isascii():
        return False  # a header no hex digest can equal (and compare_digest wants ASCII)
    return hmac.compare_digest(compute_signature(secret, body).encode(), signature.encode())


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Owner(_Model):
    login: str


class _Repository(_Model):
    id: int
    name: str
    full_name: str
    owner: _Owner


class _Installation(_Model):
    id: int


class _Job(_Model):
    id: int
    run_id: int
    run_attempt: int | None = None
    name: str
    status: str
    conclusion: str | None = None
    labels: tuple[str, ...]
    runner_id: int | None = None
    runner_name: str | None = None
    runner_group_id: int | None = None
    runner_group_name: str | None = None
    workflow_name: str | None = None
    head_branch: str | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None


class _Payload(_Model):
    action: WorkflowJobAction
    workflow_job: _Job
    repository: _Repository
    installation: _Installation | None = None


class WorkflowJobEvent(_Model):
    """A parsed ``workflow_job`` delivery. ``repository`` is ``owner/name``; ``owner`` is the
    org or user login; ``runner_*`` are set from ``in_progress`` on."""

    action: WorkflowJobAction
    delivery_id: str | None = None
    job_id: int
    run_id: int
    run_attempt: int | None = None
    name: str
    status: str
    conclusion: str | None = None
    labels: tuple[str, ...]
    runner_id: int | None = None
    runner_name: str | None = None
    runner_group_id: int | None = None
    runner_group_name: str | None = None
    workflow_name: str | None = None
    head_branch: str | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    repository: str
    owner: str
    installation_id: int | None = None


class IgnoredEvent(_Model):
    """A delivery the operator does not act on (another event, or an unknown action)."""

    event: str
    action: str | None = None
    delivery_id: str | None = None


def parse_workflow_job(
    payload: Mapping[str, Any], delivery_id: str | None = None
) -> WorkflowJobEvent:
    """Parse a ``workflow_job`` payload (decoded JSON). Raises :class:`WebhookRejected` when
    required fields are missing or malformed."""
    try:
        parsed = _Payload.model_validate(payload)
    except ValidationError as exc:
        fields = sorted({".".join(str(p) for p in err["loc"]) for err in exc.errors()})
        raise WebhookRejected(
            f"malformed workflow_job payload (fields: {', '.join(fields)})"
        ) from None
    job = parsed.workflow_job
    return WorkflowJobEvent(
        action=parsed.action,
        delivery_id=delivery_id,
        job_id=job.id,
        run_id=job.run_id,
        run_attempt=job.run_attempt,
        name=job.name,
        status=job.status,
        conclusion=job.conclusion,
        labels=job.labels,
        runner_id=job.runner_id,
        runner_name=job.runner_name,
        runner_group_id=job.runner_group_id,
        runner_group_name=job.runner_group_name,
        workflow_name=job.workflow_name,
        head_branch=job.head_branch,
        created_at=job.created_at,
        started_at=job.started_at,
        completed_at=job.completed_at,
        repository=parsed.repository.full_name,
        owner=parsed.repository.owner.login,
        installation_id=parsed.installation.id if parsed.installation else None,
    )


def parse_event(
    event: str, payload: Mapping[str, Any], delivery_id: str | None = None
) -> WorkflowJobEvent | IgnoredEvent:
    """Dispatch on the ``X-GitHub-Event`` name: ``workflow_job`` with a known action ->
    :class:`WorkflowJobEvent`; anything else -> :class:`IgnoredEvent` (explicitly ignored)."""
    action = payload.get("action")
    known = ("queued", "waiting", "in_progress", "completed")
    if event != "workflow_job" or action not in known:
        return IgnoredEvent(
            event=event, action=action if isinstance(action, str) else None, delivery_id=delivery_id
        )
    return parse_workflow_job(payload, delivery_id)


def handle_delivery(
    secret: str | bytes | None, headers: Mapping[str, str], body: bytes
) -> WorkflowJobEvent | IgnoredEvent:
    """Verify and parse one delivery (``headers`` looked up case-insensitively).

    Raises :class:`WebhookRejected` for a missing secret, missing/wrong signature, a missing
    event header or a body that is not a JSON object. Counts
    ``impvm_github_webhook_deliveries_total``."""
    lower = {k.lower(): v for k, v in headers.items()}
    verified = signature_is_valid(secret, body, lower.get(SIGNATURE_HEADER.lower()))
    return parse_delivery(headers, body, verified)


def parse_delivery(
    headers: Mapping[str, str], body: bytes, verified: bool
) -> WorkflowJobEvent | IgnoredEvent:
    """Parse one delivery whose signature the caller checked (``verified``: it matched at
    least one secret; each secret is hashed once, by the caller). Raises
    :class:`WebhookRejected` as :func:`handle_delivery` does. Counts
    ``impvm_github_webhook_deliveries_total``."""
    lower = {k.lower(): v for k, v in headers.items()}
    event = lower.get(EVENT_HEADER.lower(), "")
    label = event if event in ("workflow_job", "ping") else "other"
    if not verified:
        metrics.WEBHOOK_DELIVERIES.labels(event=label, result="rejected").inc()
        raise WebhookRejected("webhook signature missing or invalid")
    if not event:
        metrics.WEBHOOK_DELIVERIES.labels(event=label, result="invalid").inc()
        raise WebhookRejected(f"missing {EVENT_HEADER} header")
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        payload = None
    if not isinstance(payload, dict):
        metrics.WEBHOOK_DELIVERIES.labels(event=label, result="invalid").inc()
        raise WebhookRejected("webhook body is not a JSON object")
    try:
        parsed = parse_event(event, payload, lower.get(DELIVERY_HEADER.lower()))
    except WebhookRejected:
        metrics.WEBHOOK_DELIVERIES.labels(event=label, result="invalid").inc()
        raise
    result = "ignored" if isinstance(parsed, IgnoredEvent) else "accepted"
    metrics.WEBHOOK_DELIVERIES.labels(event=label, result=result).inc()
    return parsed
