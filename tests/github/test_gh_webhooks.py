"""Webhook signature verification and workflow_job parsing."""

from __future__ import annotations

import json

import pytest
from gh_support import webhook_examples

from impvm.github.webhooks import (
    IgnoredEvent,
    WebhookRejected,
    WorkflowJobEvent,
    compute_signature,
    handle_delivery,
    parse_event,
    signature_is_valid,
)

SECRET = "s3cr3t-webhook"


def _headers(body: bytes, event: str = "workflow_job", secret: str = SECRET) -> dict[str, str]:
    return {
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": "d-1",
        "X-Hub-Signature-256": compute_signature(secret, body),
    }


def test_github_docs_test_vector() -> None:
    # GitHub docs, "Validating webhook deliveries", testing the webhook payload validation.
    secret = "It's a Secret to Everybody"
    expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert compute_signature(secret, b"Hello, World!") == expected
    assert signature_is_valid(secret, b"Hello, World!", expected)
    assert not signature_is_valid(secret, b"Hello, World?", expected)
    assert not signature_is_valid("another secret", b"Hello, World!", expected)
    assert not signature_is_valid(secret, b"Hello, World!", expected.replace("sha256=", "sha1="))


@pytest.mark.parametrize("secret", [None, "", b""])
def test_missing_secret_is_a_rejection(secret: str | bytes | None) -> None:
    body = b"{}"
    assert not signature_is_valid(secret, body, compute_signature("x", body))
    with pytest.raises(WebhookRejected):
        handle_delivery(secret, _headers(body, secret="x"), body)


def test_missing_or_wrong_signature_is_a_rejection() -> None:
    body = json.dumps(webhook_examples()[0]).encode()
    headers = _headers(body)
    del headers["X-Hub-Signature-256"]
    with pytest.raises(WebhookRejected):
        handle_delivery(SECRET, headers, body)
    with pytest.raises(WebhookRejected):
        handle_delivery(SECRET, _headers(body, secret="wrong"), body)
    with pytest.raises(WebhookRejected):
        handle_delivery(SECRET, _headers(body), body + b" ")
    # a header no digest can equal, not even ASCII: rejected, not an exception
    assert not signature_is_valid(SECRET, body, "sha256=\u00e9")
    headers = _headers(body)
    headers["X-Hub-Signature-256"] = "sha256=\u00e9"
    with pytest.raises(WebhookRejected):
        handle_delivery(SECRET, headers, body)


def test_every_workflow_job_example_parses() -> None:
    examples = webhook_examples()
    assert len(examples) >= 4
    seen = set()
    for payload in examples:
        body = json.dumps(payload).encode()
        event = handle_delivery(SECRET, _headers(body), body)
        assert isinstance(event, WorkflowJobEvent)
        job = payload["workflow_job"]
        assert event.action == payload["action"]
        assert (event.job_id, event.run_id) == (job["id"], job["run_id"])
        assert event.labels == tuple(job["labels"])
        assert event.repository == payload["repository"]["full_name"]
        assert event.runner_name == job.get("runner_name")
        assert event.delivery_id == "d-1"
        seen.add(event.action)
    assert seen == {"queued", "waiting", "in_progress", "completed"}


def test_unknown_events_are_ignored_explicitly() -> None:
    body = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1}).encode()
    assert handle_delivery(SECRET, _headers(body, event="ping"), body) == IgnoredEvent(
        event="ping", action=None, delivery_id="d-1"
    )
    payload = dict(webhook_examples()[0], action="something_new")
    ignored = parse_event("workflow_job", payload)
    assert isinstance(ignored, IgnoredEvent) and ignored.action == "something_new"


def test_malformed_workflow_job_is_rejected() -> None:
    payload = dict(webhook_examples()[0])
    payload["workflow_job"] = {"id": "not-a-number"}
    body = json.dumps(payload).encode()
    with pytest.raises(WebhookRejected, match="workflow_job"):
        handle_delivery(SECRET, _headers(body), body)
    with pytest.raises(WebhookRejected):
        handle_delivery(SECRET, _headers(b"[1]"), b"[1]")
