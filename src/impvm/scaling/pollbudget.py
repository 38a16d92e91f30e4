"""Which repositories one poll of an installation reads, within its budget. Pure: no I/O, time
is an argument.

GitHub has no org-wide job queue: a poll reads, per repository, the workflow runs ``queued``
and ``in_progress`` (REST "Workflow runs", list workflow runs for a repository: one request per
page of 100) and the jobs of runs that changed (REST "Workflow jobs"); the repositories come from
the installation's listing (REST "Installations", one request per 100 repositories). One poller
per installation does this for every pool of the installation.

**Budget.** Two bounds, both per installation:

* *all calls*: a token bucket (:class:`Bucket`) refilled at ``calls_per_hour`` and capped at
  ``burst_seconds`` of refill; 304s count (a 304 costs no rate limit but is a round trip, and
  GitHub's secondary limits count requests: REST "Rate limits for the REST API");
* *rate-limited calls* (every answer but a 304): at most ``rate_limit_share`` of the
  installation's primary limit ``L`` in each of GitHub's rate-limit windows
  (:class:`RateWindow`; ``x-ratelimit-limit`` and ``x-ratelimit-reset``: a GitHub App
  installation has 5,000 an hour, more on large organisations, REST "Rate limits for GitHub
  Apps"). A 304 with ``Authorization`` does not count against it (REST "Best practices",
  conditional requests). JIT configs and runner listings draw on the rest of ``L``.

A poll plans ``B = min(floor(bucket tokens), share * L - used in this window)`` requests, each
assumed to cost rate limit. Both are charged afterwards with what the poll really made, so a
poll that found more changed runs than planned leaves debt that the next polls pay back: over
any ``T`` seconds the poller makes at most ``calls_per_hour * T / 3600 + cap + one poll's
overrun`` requests, and in each window at most ``share * L + one poll's overrun`` that cost
rate limit.

**Spread.** Each repository has an estimated cost ``c(r)``: the run listings its last read
made (2, one page each, unless it has more than 100 open runs), 2 before its first; the jobs
reads of runs that changed are charged when made. *Hot* repositories
(open runs at their last read, or open jobs in the job table from webhooks) are read first,
every poll, while they fit in ``B`` less a reserve for the others (``R = max(2, B / 2)``, so
that many busy repositories do not stall the sweep; beyond ``B - R`` they take turns); then
the others (*cold*) least recently read first, as long as they fit, so they go round-robin
across polls. With ``H`` the cost of
the hot ones and ``N`` cold repositories (``c = 2`` each), every cold repository is read at
least once every ``ceil(N / floor(max(B - H, R) / 2))`` polls (:func:`sweep_polls`; no hot
repository bigger than ``B`` assumed). At the start of each sweep the installation's
repositories are listed again (``ceil(N / 100)`` requests, taken from ``B`` first). When the
least recently read hot repository alone exceeds ``B`` (more open runs than ``B``), it is read
alone: the poll overruns by at most that one repository and the debt delays the next polls, so
the hourly budgets hold.

With the defaults (``calls_per_hour`` 18,000, polls every 30 s: ``B = 150``), 50 repositories
are all read in every poll (101 requests) and 500 in ``ceil(500 / floor((150 - 5) / 2)) = 7``
polls, 3.5 minutes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

__all__ = [
    "BASE_REPO_COST",
    "Bucket",
    "PollBudget",
    "RateWindow",
    "RepoChoice",
    "choose_repos",
    "cold_reserve",
    "sweep_polls",
]

#: requests per repository and poll without open runs: the ``queued`` and ``in_progress`` listings
BASE_REPO_COST = 2


@dataclass(frozen=True, slots=True)
class PollBudget:
    """The per-installation poll budget: ``calls_per_hour`` (all requests), ``rate_limit_share``
    (of the primary limit, for requests that count against it), ``burst_seconds`` (the buckets
    hold this many seconds of refill: after a quiet spell a poll may read that much at once)."""

    calls_per_hour: float = 18000.0
    rate_limit_share: float = 0.5
    burst_seconds: float = 60.0

    def __post_init__(self) -> None:
        finite = math.isfinite(self.calls_per_hour) and math.isfinite(self.burst_seconds)
        if not finite or self.calls_per_hour <= 0 or self.burst_seconds <= 0:
            raise ValueError("calls_per_hour and burst_seconds must be positive and finite")
        if not 0 < self.rate_limit_share <= 1:
            raise ValueError("rate_limit_share must be in (0, 1]")

    def per_poll(self, interval_seconds: float) -> int:
        """Calls one poll may plan when polls come every ``interval_seconds`` (steady state)."""
        seconds = min(interval_seconds, self.burst_seconds)
        return math.floor(self.calls_per_hour * seconds / 3600)


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: ``tokens`` (may be negative: debt) at monotonic second ``at``."""

    tokens: float
    at: float

    @classmethod
    def full(cls, per_hour: float, burst_seconds: float, at: float) -> Bucket:
        return cls(per_hour * burst_seconds / 3600, at)

    def refilled(self, per_hour: float, burst_seconds: float, now: float) -> Bucket:
        """The bucket at ``now``: ``per_hour / 3600`` tokens a second, capped at
        ``burst_seconds`` of refill (a clock that went back adds nothing)."""
        cap = per_hour * burst_seconds / 3600
        grown = self.tokens + max(0.0, now - self.at) * per_hour / 3600
        return Bucket(min(cap, grown), max(now, self.at))

    def spent(self, calls: float) -> Bucket:
        return Bucket(self.tokens - calls, self.at)


@dataclass(frozen=True, slots=True)
class RateWindow:
    """Rate-limited requests the poller made (``used``) in GitHub's window ending at ``reset``
    (epoch s, ``x-ratelimit-reset``; 0: unknown yet)."""

    reset: int = 0
    used: int = 0

    def at(self, reset: int) -> RateWindow:
        """This window, or a fresh one when GitHub reports another reset time (a new window)."""
        if reset and reset != self.reset:
            return RateWindow(reset, 0 if self.reset else self.used)
        return self

    def left(self, share: float, limit: int) -> int:
        """Requests the poller may still make in this window: ``share * limit - used``."""
        return math.floor(share * limit) - self.used

    def charged(self, rate_limited: int) -> RateWindow:
        return RateWindow(self.reset, self.used + rate_limited)


@dataclass(frozen=True, slots=True)
class RepoChoice:
    """The repositories one poll reads, in order, and their estimated cost (requests)."""

    read: tuple[str, ...]
    cost: int


def cold_reserve(budget: int) -> int:
    """Requests of a poll's ``budget`` kept for cold repositories while there are any: half, at
    least one repository's two listings. A job in an idle repository matters as much as a
    change in a busy one: with many busy repositories (hundreds of queued jobs) a smaller
    reserve would leave the sweep crawling while they take turns."""
    return max(BASE_REPO_COST, budget // 2)


def repo_cost(repo: str, cost: Mapping[str, int]) -> int:
    """Estimated requests to read ``repo``: the run listings its last read made (``cost``), at
    least the two of one page each."""
    return max(BASE_REPO_COST, cost.get(repo, BASE_REPO_COST))


def choose_repos(
    repos: Sequence[str],
    hot: AbstractSet[str],
    cost: Mapping[str, int],
    last_read: Mapping[str, int],
    budget: int,
) -> RepoChoice:
    """Which of ``repos`` (``owner/name``, no duplicates) this poll reads with ``budget``
    requests: the hot ones first (``hot``; least recently read first, so that hot repositories
    that do not all fit take turns) within the budget less :func:`cold_reserve` (when there
    are cold ones), then the cold ones least recently read first
    (``last_read``: the number of the poll that last read each; a repository never read comes
    first), each while its cost (:func:`repo_cost`) fits what is left. Cold repositories stop at
    the first that does not fit (the oldest is never overtaken, which bounds every repository's
    wait). The total never exceeds ``budget``, but for one case: when ``budget`` is positive and
    the least recently read hot repository alone does not fit, it is read alone (else a
    repository with more open runs than the budget would never be read again)."""

    def age(r: str) -> tuple[int, str]:
        return (last_read.get(r, -1), r)

    hot_first = sorted((r for r in repos if r in hot), key=age)
    cold = sorted((r for r in repos if r not in hot), key=age)
    if budget > 0 and hot_first and repo_cost(hot_first[0], cost) > budget:
        return RepoChoice((hot_first[0],), repo_cost(hot_first[0], cost))
    left = budget
    hot_left = budget - cold_reserve(budget) if cold else budget
    read: list[str] = []
    for r in hot_first:
        c = repo_cost(r, cost)
        if c <= min(left, hot_left):
            read.append(r)
            left -= c
            hot_left -= c
    for r in cold:
        c = repo_cost(r, cost)
        if c > left:
            break
        read.append(r)
        left -= c
    return RepoChoice(tuple(read), budget - left)


def sweep_polls(repos: int, hot_cost: int, budget: int, listing_pages: int = 0) -> int | None:
    """Polls one sweep of ``repos`` cold repositories takes with ``budget`` requests a poll of
    which ``hot_cost`` go to hot repositories and ``listing_pages`` to the repositories listing:
    ``ceil(repos / floor(max(b - hot_cost, cold_reserve(b)) / 2))`` with ``b = budget -
    listing_pages`` (no hot repository bigger than the budget); None when nothing is left for
    them."""
    if repos == 0:
        return 0
    rest = budget - listing_pages
    left = max(rest - hot_cost, min(cold_reserve(rest), rest))
    if left < BASE_REPO_COST:
        return None
    per_poll = left // BASE_REPO_COST
    return math.ceil(repos / per_poll)
