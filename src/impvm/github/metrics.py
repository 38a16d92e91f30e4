"""Prometheus metrics of the GitHub integration (names start with ``impvm_``).

Labels carry templated endpoints (``/orgs/{org}/actions/runners``), methods, statuses and
resource names only: never a token, key, JIT config or concrete org/repo name.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

API_CALLS = Counter(
    "impvm_github_api_calls_total",
    "GitHub REST calls by templated endpoint, method and HTTP status (or 'timeout'/'error').",
    ["endpoint", "method", "status"],
)
RATE_LIMIT_REMAINING = Gauge(
    "impvm_github_rate_limit_remaining",
    "Last seen x-ratelimit-remaining by rate-limit resource (core, search, ...).",
    ["resource"],
)
TOKEN_MINTS = Counter(
    "impvm_github_token_mints_total",
    "Installation token exchanges by result (ok or the error class name).",
    ["result"],
)
RATE_LIMIT_WAITS = Counter(
    "impvm_github_rate_limit_waits_total",
    "Times the client waited for a rate limit, by kind (primary, secondary).",
    ["kind"],
)
WEBHOOK_DELIVERIES = Counter(
    "impvm_github_webhook_deliveries_total",
    "Webhook deliveries by event and result (accepted, ignored, rejected, invalid).",
    ["event", "result"],
)
