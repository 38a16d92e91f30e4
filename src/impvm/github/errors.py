"""Typed errors of the GitHub integration.

Every error carries what a caller needs to act (status, endpoint template, a retry hint) and
never a secret: messages are built from the templated endpoint, the HTTP status and GitHub's
``message`` field after redaction of every secret the client holds.

Source of the status mapping: GitHub REST docs, "Troubleshooting the REST API" and
"Rate limits for the REST API"; "Authenticating as a GitHub App installation".
"""

from __future__ import annotations


class GitHubError(Exception):
    """Base class. ``endpoint`` is a templated path (``/orgs/{org}/actions/runners``), ``status``
    the HTTP status (``None`` for transport failures)."""

    def __init__(self, message: str, *, endpoint: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


class CredentialsError(GitHubError):
    """The credentials Secret is incomplete or malformed (missing key, unparsable app id or
    private key). Raised before any request is made."""


class BadCredentials(GitHubError):
    """401: the JWT or token was refused (wrong key, expired or revoked token, bad PAT)."""


class InstallationUnavailable(GitHubError):
    """The App installation cannot be used: ``reason`` is ``"suspended"`` (403) or ``"removed"``
    (404 on the token exchange): the token mint reports the installation as unavailable."""

    def __init__(self, message: str, *, reason: str, endpoint: str = "", status: int) -> None:
        super().__init__(message, endpoint=endpoint, status=status)
        self.reason = reason


class PermissionNotGranted(GitHubError):
    """422 on the token exchange (requested permission not granted to the installation) or 403
    "Resource not accessible by integration" on a call."""


class NotFound(GitHubError):
    """404 on a resource (org, repository, runner group, runner, run, job)."""


class Conflict(GitHubError):
    """409, e.g. a runner with the requested name already exists (JIT config)."""


class RateLimited(GitHubError):
    """Rate limit exceeded and the client will not wait (its policy does not wait, the wait is
    longer than its bound, or retries are exhausted): the caller decides. ``kind`` is
    ``"primary"`` or ``"secondary"``; ``retry_after`` is seconds from now after which a retry
    may succeed; ``reset_at`` the same moment in epoch seconds of the client's clock."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        retry_after: float,
        endpoint: str = "",
        status: int,
        reset_at: float | None = None,
    ) -> None:
        super().__init__(message, endpoint=endpoint, status=status)
        self.kind = kind
        self.retry_after = retry_after
        self.reset_at = reset_at


class TransientError(GitHubError):
    """5xx, timeout or connection failure that persisted through the bounded retries."""


class RequestRejected(GitHubError):
    """Any other 4xx (e.g. 400/422 validation failure of a request body)."""
