"""What GitHub answered a pool pass: the pool's runner registrations, the rate-limit budget,
the failure that stopped a call (:class:`FailureKind`: the error classes of
:mod:`impvm.github.errors` as the decision needs them), the poll that answered the pass. Pure
data, without secrets."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "FailureKind",
    "GitHubFailure",
    "GitHubView",
    "PollOutcome",
    "RateBudget",
    "RunnerView",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerView:
    """What GitHub says about one runner registration whose name starts with the pool's prefix
    (``GET /orgs/{org}/actions/runners`` or the repository form): ``id``, ``name``, ``online``
    (``status == "online"``) and ``busy``."""

    id: int
    name: str
    online: bool
    busy: bool


class FailureKind(StrEnum):
    """What kind of GitHub (or credentials) failure stopped a pass (:mod:`impvm.github.errors`;
    the values are Event, condition and metric reasons)."""

    CREDENTIALS_ERROR = "CredentialsError"
    BAD_CREDENTIALS = "BadCredentials"
    PERMISSION_NOT_GRANTED = "PermissionNotGranted"
    INSTALLATION_UNAVAILABLE = "InstallationUnavailable"
    RATE_LIMITED = "RateLimited"
    REQUEST_REJECTED = "RequestRejected"
    NOT_FOUND = "NotFound"
    CONFLICT = "Conflict"
    TRANSIENT = "TransientError"
    OTHER = "GitHubError"

    @property
    def credentials(self) -> bool:
        """The credentials are at fault (``CredentialsInvalid``)."""
        return self in (
            FailureKind.CREDENTIALS_ERROR,
            FailureKind.BAD_CREDENTIALS,
            FailureKind.PERMISSION_NOT_GRANTED,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GitHubFailure:
    """A GitHub (or credentials) error as the decision needs it; never holds a secret.

    ``kind``: :class:`FailureKind`; ``message`` its redacted text; ``retry_after`` the seconds
    a rate limit asks to wait; ``rate_kind`` ``primary`` or ``secondary``;
    ``unavailable_reason`` ``suspended`` or ``removed``; ``vm`` the VM whose JIT config was
    being minted, when that failed."""

    kind: FailureKind
    message: str
    retry_after: float = 0.0
    rate_kind: str = ""
    unavailable_reason: str = ""
    vm: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RateBudget:
    """The core rate-limit budget as the last response reported it (``reset``: epoch s) and
    the installation it belongs to (``installation``: a name without secrets, e.g.
    ``api.github.com app 4242 installation 777``; empty when unknown)."""

    limit: int
    remaining: int
    reset: int
    installation: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class GitHubView:
    """What GitHub said this pass.

    - ``connected``: credentials were read and a client exists;
    - ``skipped``: the pool is in backoff, so no call was made;
    - ``runners``: the pool's registrations (already restricted to its names), None if unknown;
    - ``failure``: the credentials or listing error of this pass;
    - ``budget``: the rate-limit budget, if known;
    - ``mint_allowance``: JIT configs the pool may mint now within its share of the
      installation's budget (None: no bound).
    """

    connected: bool = False
    skipped: bool = False
    runners: tuple[RunnerView, ...] | None = None
    failure: GitHubFailure | None = None
    budget: RateBudget | None = None
    mint_allowance: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PollOutcome:
    """The poll that answered this pass (the installation's, shared by its pools): when it
    finished, what it saw and cost, or why it failed; ``started``: when it started (monotonic
    s; None: this pass's reading), which becomes the pool's ``PollState.last_poll``, so pools
    served by one poll fall due together and share the next one too; ``swept``: every
    repository of the installation had been read once when it finished."""

    time: dt.datetime
    queued: int = 0
    api_calls: int = 0
    failure: GitHubFailure | None = None
    started: float | None = None
    swept: bool = True
