"""What the GitHub client returns and is configured with: the runner scope, JIT configs,
runners, workflow runs and jobs, repositories, rate-limit buckets, listings read with conditional
requests, and the retry policy. Plain frozen values; no I/O.

Sources: GitHub REST docs "Self-hosted runners", "Workflow runs", "Workflow jobs",
"Installations" and "Rate limit" (the fields kept are theirs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, Literal, TypeVar

from pydantic import SecretStr

T = TypeVar("T")

DEFAULT_API_URL = "https://api.github.com"
#: Runner group id of repository-level runners (repositories have only the "Default" group).
REPO_RUNNER_GROUP_ID = 1

RunStatus = Literal[
    "queued", "in_progress", "completed", "waiting", "requested", "pending", "action_required"
]


@dataclass(frozen=True)
class Scope:
    """Where runners register: exactly one of ``org`` (login) or ``repo`` (``owner/name``)."""

    org: str | None = None
    repo: str | None = None

    def __post_init__(self) -> None:
        if (self.org is None) == (self.repo is None):
            raise ValueError("Scope needs exactly one of org or repo")
        if self.repo is not None and self.repo.count("/") != 1:
            raise ValueError("Scope.repo must be 'owner/name'")

    @property
    def owner_repo(self) -> tuple[str, str]:
        """``(owner, name)`` of a repository scope; ``ValueError`` for an org scope."""
        if self.repo is None:
            raise ValueError("not a repository scope")
        owner, name = self.repo.split("/")
        return owner, name

    def __str__(self) -> str:
        return f"org {self.org}" if self.org is not None else f"repo {self.repo}"


@dataclass(frozen=True)
class JitConfig:
    """Result of a JIT request. ``encoded_jit_config`` is opaque and secret: ``repr``/``str``
    never show it; read it with ``.get_secret_value()`` only to write the VM's Secret."""

    runner_id: int
    runner_name: str
    encoded_jit_config: SecretStr


@dataclass(frozen=True)
class Runner:
    """A self-hosted runner as GitHub reports it. ``status`` is ``"online"``/``"offline"``."""

    id: int
    name: str
    status: str
    busy: bool
    labels: tuple[str, ...]
    os: str
    runner_group_id: int | None
    ephemeral: bool | None


class DeleteOutcome(enum.Enum):
    """Outcome of :meth:`GitHubClient.delete_runner`."""

    DELETED = "deleted"
    BUSY = "busy"
    NOT_FOUND = "not_found"


@dataclass(frozen=True)
class WorkflowRun:
    """A workflow run (subset). ``repository`` is ``owner/name``."""

    id: int
    name: str | None
    status: str | None
    conclusion: str | None
    repository: str
    run_attempt: int | None
    event: str
    head_branch: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class WorkflowJob:
    """A workflow job (subset). ``runner_*`` are set once a runner took the job."""

    id: int
    run_id: int
    name: str
    status: str
    conclusion: str | None
    labels: tuple[str, ...]
    runner_id: int | None
    runner_name: str | None
    runner_group_id: int | None
    workflow_name: str | None
    head_branch: str | None
    created_at: datetime
    started_at: datetime
    completed_at: datetime | None


@dataclass(frozen=True)
class Repository:
    """A repository the installation can access."""

    id: int
    full_name: str
    owner: str
    name: str
    private: bool


@dataclass(frozen=True)
class RateLimitBucket:
    """One rate-limit resource: ``reset`` is epoch seconds."""

    limit: int
    remaining: int
    used: int
    reset: int


@dataclass(frozen=True)
class Listed(Generic[T]):
    """A list read page by page with conditional requests: the ``items``, the requests made
    (``calls``, one per page) and how many of them GitHub answered 304 Not Modified
    (``not_modified``; the kept answer was used). ``unchanged``: every page was a 304, so the
    list is what it was at the last read (source: REST "Best practices for using the REST
    API", use conditional requests)."""

    items: list[T]
    calls: int
    not_modified: int

    @property
    def unchanged(self) -> bool:
        return self.calls > 0 and self.not_modified == self.calls


@dataclass(frozen=True)
class RetryPolicy:
    """Retry bounds (seconds). Transient failures (5xx, timeouts, connection errors) are retried
    ``max_transient_retries`` times with full-jitter exponential backoff
    (``min(max_delay, base_delay * 2**n) * U[0.5, 1]``). Rate limits are waited for at most
    ``max_rate_limit_retries`` times and never longer than ``max_rate_limit_wait`` per wait;
    beyond that :class:`RateLimited` is raised with ``retry_after`` and ``reset_at``. With
    ``max_rate_limit_retries=0`` the client never waits: the caller decides (the operator's
    pool pass records the condition at once and schedules its retry). A secondary limit without
    ``retry-after`` waits ``secondary_min_wait * 2**n``."""

    max_transient_retries: int = 4
    base_delay: float = 1.0
    max_delay: float = 30.0
    max_rate_limit_retries: int = 3
    max_rate_limit_wait: float = 900.0
    secondary_min_wait: float = 60.0
