"""The GitHub stand-in's records: what it knows of Apps, installations, orgs, repositories,
runner groups, runners, tokens, workflow runs and jobs, injected failures, rate-limit buckets and
webhook targets and deliveries (plain dataclasses; :mod:`impvm.devstack.standin.state` holds them
and the operations on them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey


@dataclass
class App:
    id: int
    slug: str
    public_key: RSAPublicKey
    #: further keys GitHub accepts for the App (an App may have several private keys at once,
    #: "Managing private keys for GitHub Apps": how a key is rotated without downtime)
    more_keys: list[RSAPublicKey] = field(default_factory=list)

    @property
    def keys(self) -> list[RSAPublicKey]:
        return [self.public_key, *self.more_keys]


@dataclass
class Installation:
    id: int
    app_id: int
    account: str
    permissions: dict[str, str]
    suspended: bool = False
    removed: bool = False


@dataclass
class Org:
    login: str
    id: int


@dataclass
class Repo:
    id: int
    owner: str
    name: str
    private: bool = True

    @property
    def full_name(self) -> str:
        return f"{self.owner}/{self.name}"


@dataclass
class RunnerGroup:
    id: int
    org: str
    name: str
    default: bool = False
    visibility: str = "all"


@dataclass
class RunnerRec:
    id: int
    name: str
    labels: list[str]
    group_id: int
    org: str | None
    repo: str | None
    session_token: str
    work_folder: str
    status: str = "offline"
    busy: bool = False
    job_id: int | None = None
    os: str = "Linux"
    ephemeral: bool = True
    #: epoch seconds of the runner's last contact (session, acquire, heartbeat, complete)
    last_seen: float = 0.0


@dataclass
class TokenRec:
    token: str
    installation_id: int | None
    account: str
    permissions: dict[str, str]
    expires_at: float


@dataclass
class RunRec:
    id: int
    repo: str
    name: str
    workflow_id: int
    run_number: int
    created_at: float
    updated_at: float
    status: str = "queued"
    conclusion: str | None = None
    run_attempt: int = 1
    head_branch: str = "main"
    head_sha: str = "0" * 40
    event: str = "push"


@dataclass
class JobRec:
    id: int
    run_id: int
    repo: str
    name: str
    labels: list[str]
    created_at: float
    workflow_name: str
    command: list[str] | None = None
    sleep_seconds: float = 0.0
    status: str = "queued"
    conclusion: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    runner_id: int | None = None
    runner_name: str | None = None
    runner_group_id: int | None = None
    runner_group_name: str | None = None
    head_branch: str = "main"
    head_sha: str = "0" * 40
    run_attempt: int = 1


@dataclass
class Failure:
    """An injected failure for the next ``count`` matching API requests.

    ``kind``: ``status`` (respond ``status`` with ``message``), ``timeout`` (delay ``delay`` s
    before answering normally), ``primary_rate_limit`` (403, remaining 0, reset in
    ``reset_in`` s), ``secondary_rate_limit`` (403 with ``retry-after`` if ``retry_after``
    is set, else without), ``suspend`` (403 installation suspended).

    ``probability`` (0..1): the share of matching requests that fail (each draws at random; one
    that does not fail leaves ``count`` as it was), for a GitHub that fails some calls rather
    than the next few."""

    kind: str
    count: int = 1
    method: str | None = None
    path: str | None = None
    status: int = 502
    message: str = "Server Error"
    delay: float = 0.0
    retry_after: int | None = None
    reset_in: int = 60
    probability: float = 1.0


@dataclass
class RateBucket:
    limit: int = 5000
    remaining: int = 5000
    reset: float = 0.0


@dataclass
class Delivery:
    id: str
    event: str
    action: str
    status: int | None
    error: str | None = None


@dataclass
class WebhookTarget:
    url: str
    secret: str
    #: fraction of deliveries silently lost (tests of webhook loss), 0..1
    drop_rate: float = 0.0
    #: the App whose webhook this is: it receives only the events of that App's installations
    #: (None: every event, like an organisation webhook of every org)
    app_id: int | None = None
