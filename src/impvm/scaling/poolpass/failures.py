"""GitHub failures in the pool pass's conclusion: which condition each sets, what the Ready
condition says, and the backoff (exponential, full jitter) of the pool's GitHub work. Pure.

Failure boundaries (Kubernetes API conventions: conditions say what is wrong; GitHub REST docs,
"Troubleshooting the REST API" and "Rate limits for the REST API" for the error classes):

- credentials Secret missing or incomplete -> ``CredentialsInvalid`` (``CredentialsError``);
- 401 -> ``CredentialsInvalid`` (``BadCredentials``); a permission not granted ->
  ``CredentialsInvalid`` (``PermissionNotGranted``);
- installation suspended or removed -> ``GitHubUnavailable`` (``InstallationUnavailable``);
- rate limit -> ``RateLimited`` (``PrimaryRateLimit``/``SecondaryRateLimit``, with the reset
  time), backoff until the reset; a low budget pauses polling (``BudgetLow``) but not minting;
- a request GitHub refused (other 4xx) -> only ``Ready`` says so (GitHub is not down);
- 5xx, timeouts -> ``GitHubUnavailable``; every GitHub failure backs off and a JIT config that
  was not minted leaves its VM without a Secret, retried after the backoff.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from impvm.api.conditions import ConditionSet
from impvm.api.times import k8s_time
from impvm.scaling.names import secret_name
from impvm.scaling.poolpass.acts import ActsDone, EventSpec, PoolActs
from impvm.scaling.poolpass.memory import BackoffState
from impvm.scaling.poolpass.world import FailureKind, GitHubFailure, PoolWorld

__all__ = ["GitHubVerdict", "github_condition", "github_verdict", "wait"]


def github_condition(failure: GitHubFailure) -> tuple[str, str, str] | None:
    """The condition ``(type, reason, message)`` a GitHub failure sets to True, or None when
    it sets none (GitHub refused one request: ``RequestRejected``; only ``Ready`` says so)."""
    kind, msg = failure.kind, failure.message
    if kind is FailureKind.REQUEST_REJECTED:
        return None
    if kind.credentials:
        return ("CredentialsInvalid", kind.value, msg)
    if kind is FailureKind.RATE_LIMITED:
        return ("RateLimited", f"{failure.rate_kind.capitalize()}RateLimit", msg)
    if kind is FailureKind.INSTALLATION_UNAVAILABLE:
        text = f"the GitHub App installation is unavailable ({failure.unavailable_reason}): {msg}"
        return ("GitHubUnavailable", "InstallationUnavailable", text)
    return ("GitHubUnavailable", kind.value, msg)


def wait(backoff: BackoffState, mono: float) -> float:
    """Seconds until ``backoff`` lets GitHub be called again."""
    return max(0.0, backoff.not_before - mono)


@dataclass(frozen=True, slots=True)
class GitHubVerdict:
    """What GitHub's answers this pass leave: the ``backoff``, what ``Ready`` says when it is
    False (``(reason, message)``; None: GitHub is not why), and the last failure."""

    backoff: BackoffState
    ready_failure: tuple[str, str] | None
    last: GitHubFailure | None


def github_verdict(
    world: PoolWorld,
    acts: PoolActs,
    done: ActsDone,
    conds: ConditionSet,
    events: list[EventSpec],
) -> GitHubVerdict:
    """Conditions and Events of this pass's GitHub failures (listing, poll, acts), the backoff
    they leave, and the Ready failure (a mint that failed, a Secret not written, a pass that
    could not call GitHub)."""
    g, s, now, mono = world.github, world.settings, world.now, world.mono
    backoff = world.memory.backoff
    ready_failure: tuple[str, str] | None = None
    if g.skipped:
        ready_failure = (
            "GitHubBackoff",
            f"{backoff.last_error}; retry in {wait(backoff, mono):.0f}s",
        )
    if g.runners is not None and g.failure is None:
        conds.set("CredentialsInvalid", False, "Valid", "credentials accepted by GitHub", now)
        conds.set("GitHubUnavailable", False, "Available", "GitHub answered", now)
        conds.set("RateLimited", False, "WithinLimits", "", now)

    def failed(message: str, at_least: float = 0.0) -> BackoffState:
        return backoff.failed(
            mono,
            world.jitter,
            message=message,
            at_least=at_least,
            base=s.backoff_base_seconds,
            cap=s.backoff_cap_seconds,
        )

    failures = [f for f in (g.failure, world.polled and world.polled.failure, done.failure) if f]
    for f in failures:
        mapped = github_condition(f)
        said = mapped[2] if mapped else f.message  # what the Event and the backoff say
        before = backoff.last_error
        limited = f.kind is FailureKind.RATE_LIMITED
        backoff = failed(said, f.retry_after if limited else 0.0)
        if mapped is None:
            changed = ready_failure is None
            ready_failure = ready_failure or ("GitHubRejected", f.message)
        else:
            ctype, reason, text = mapped
            if ctype == "RateLimited":
                text = f"{text}; resets {k8s_time(now + dt.timedelta(seconds=f.retry_after))}"
            changed = conds.set(ctype, True, reason, text, now)
        if changed or before != said:
            # a Secret lacking a key is a local problem, not an answer of GitHub's
            local = f.kind is FailureKind.CREDENTIALS_ERROR
            events.append(EventSpec("CredentialsInvalid" if local else "GitHubError", said, True))
        if f.vm is not None:
            retry = wait(backoff, mono)
            text = f"JIT config for {f.vm} not minted ({f.kind.value}); retry in {retry:.0f}s"
            ready_failure = ("JitMintFailed", text)
    kinds = {m[0] for f in failures if (m := github_condition(f)) is not None}
    if "RateLimited" in kinds and "GitHubUnavailable" not in kinds:
        # a rate-limit answer is an answer: an earlier 5xx or timeout no longer holds
        conds.set("GitHubUnavailable", False, "Available", "GitHub answered", now)
    if done.secret_write_failed:
        msg = done.secret_write_failed
        # each retry mints (and replaces) a registration: back off like a GitHub error
        backoff = failed(msg)
        ready_failure = ("SecretWriteFailed", msg)
        events.append(EventSpec("SecretWriteFailed", msg, warning=True))
    sizing = acts.sizing
    wants = sizing is not None and (
        sizing.create > 0
        or any(secret_name(m.name) not in world.secrets for m in sizing.mint_secrets)
    )
    if not acts.use_github and wants and ready_failure is None:
        ready_failure = (
            "GitHubBackoff",
            f"{backoff.last_error}; retry in {wait(backoff, mono):.0f}s",
        )
    if g.connected and not g.skipped and not failures and not done.secret_write_failed:
        backoff = backoff.succeeded()
    return GitHubVerdict(backoff, ready_failure, failures[-1] if failures else None)
