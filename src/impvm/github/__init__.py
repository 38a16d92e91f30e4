"""impvm.github: GitHub App auth, REST calls, webhook verification and parsing.

Public API: :class:`GitHubClient`, :class:`Scope`, credentials (:class:`AppCredentials`,
:class:`PatCredentials`, :func:`credentials_from_secret`), result types, the errors in
:mod:`impvm.github.errors`, and :mod:`impvm.github.webhooks`.
"""

from impvm.github.auth import (
    AppCredentials,
    Credentials,
    PatCredentials,
    create_app_jwt,
    credentials_from_secret,
)
from impvm.github.client import GitHubClient
from impvm.github.transport import api_base_url
from impvm.github.types import (
    REPO_RUNNER_GROUP_ID,
    DeleteOutcome,
    JitConfig,
    Listed,
    RateLimitBucket,
    Repository,
    RetryPolicy,
    Runner,
    Scope,
    WorkflowJob,
    WorkflowRun,
)

__all__ = [
    "REPO_RUNNER_GROUP_ID",
    "AppCredentials",
    "Credentials",
    "DeleteOutcome",
    "GitHubClient",
    "JitConfig",
    "Listed",
    "PatCredentials",
    "RateLimitBucket",
    "Repository",
    "RetryPolicy",
    "Runner",
    "Scope",
    "WorkflowJob",
    "WorkflowRun",
    "api_base_url",
    "create_app_jwt",
    "credentials_from_secret",
]
