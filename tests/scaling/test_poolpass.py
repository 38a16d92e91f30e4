"""The pure pool pass (impvm.scaling.poolpass): its first phase (poll first?), the acts it decides
and its conclusion, table tests first, then properties over arbitrary worlds (conditions a
function of the world, the clock honouring cooldown, backoff and bootstrap timeouts). That a
pass's acts leave nothing for the next pass to do is tested with the real executor
(tests/operator/test_pool_fixpoint.py)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.api.models import AGENT_FINALIZER, TEMPLATE_HASH_ANNOTATION
from impvm.api.patches import wire
from impvm.scaling.jobs import Job
from impvm.scaling.names import MAX_RUNNER_NAME, owns_runner_name, runner_prefix, vm_name
from impvm.scaling.nodes import NodeLease
from impvm.scaling.poolpass import (
    ActsDone,
    BackoffState,
    FailureKind,
    GitHubFailure,
    GitHubView,
    PassConclusion,
    PollOutcome,
    PollRequest,
    PollState,
    PoolWorld,
    RateBudget,
    Reason,
    VerifyKey,
    conclude_pass,
    github_condition,
    poll_first,
    poll_since,
    poll_wanted,
    pool_acts,
)
from impvm.scaling.settings import PassSettings
from tests.scaling.builders import (
    CLASS,
    IMAGE,
    MONO,
    NEW_IMAGE,
    NOW,
    PREFIX,
    ago,
    one_pass,
    pool_obj,
    reg,
    vm,
    world,
)


def conds(end: PassConclusion) -> dict[str, dict[str, Any]]:
    return {str(c["type"]): dict(c) for c in end.conditions}


def reasons(end: PassConclusion) -> list[str]:
    return [e.reason for e in end.events]


def status(end: PassConclusion) -> dict[str, Any]:
    return wire(end.status)


def remembering(w: PoolWorld, **memory: Any) -> PoolWorld:
    """``w`` with its memory (backoff, poll state) as a last pass left it."""
    return dataclasses.replace(w, memory=dataclasses.replace(w.memory, **memory))


def polled(w: PoolWorld, outcome: PollOutcome, pending: int = 0) -> PoolWorld:
    """``w`` once the poll it asked for answered (the job table read again)."""
    return w.after_poll(outcome, dataclasses.replace(w, pending_jobs=pending))


# --------------------------------------------------------------------------------------------
# Template and class


def test_template_missing_blocks_everything_and_requeues_after_30s() -> None:
    w = world(template=None, vm_class=None, vms=(vm("aaaaaa", phase="Failed"),))
    acts, end = one_pass(w)
    assert acts.count == 0 and acts.sizing is None and poll_first(w) is None
    c = conds(end)
    assert (c["TemplateMissing"]["status"], c["TemplateMissing"]["reason"]) == ("True", "NotFound")
    assert "'tpl' not found in namespace ns" in c["TemplateMissing"]["message"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "TemplateMissing")
    assert end.requeue == 30.0
    assert reasons(end) == ["TemplateMissing"]
    assert status(end) == {"observedGeneration": 3}

    # stored as such: the next pass sends no second Event and needs no write
    stored = {**status(end), "conditions": list(end.conditions)}
    _, again = one_pass(world(template=None, vm_class=None, pool=pool_obj(status=stored)))
    assert reasons(again) == [] and not again.write


def test_class_missing_names_the_class() -> None:
    c = conds(one_pass(world(vm_class=None))[1])
    assert c["TemplateMissing"]["reason"] == "ClassNotFound"
    assert "'small'" in c["TemplateMissing"]["message"]


def test_found_template_clears_the_condition_and_makes_vms_of_its_hash() -> None:
    acts, end = one_pass(world())
    assert conds(end)["TemplateMissing"]["status"] == "False"
    assert acts.create == 1 and len(acts.made_from) == 16  # the template hash of new VMs


PEM = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"


def test_a_signing_key_goes_into_the_template_hash() -> None:
    key = VerifyKey(pem=PEM, fingerprint="sha256:" + "a" * 64)
    unsigned = pool_acts(world())
    signed = pool_acts(world(verify_key=key))
    assert signed.made_from != unsigned.made_from
    # a rotated key makes the idle VMs made with the old one outdated (they roll)
    h = TEMPLATE_HASH_ANNOTATION
    made = dataclasses.replace(
        vm("aaaaaa", runner=(1, True, False)), annotations={h: signed.made_from}
    )  # made with the key
    w = world((made,), (reg(1, "aaaaaa"),), verify_key=key)
    assert status(one_pass(w)[1])["outdated"] == 0
    rotated = dataclasses.replace(key, fingerprint="sha256:" + "b" * 64)
    assert status(one_pass(dataclasses.replace(w, verify_key=rotated))[1])["outdated"] == 1


def test_an_unusable_signing_key_blocks_every_vm_and_requeues_after_30s() -> None:
    problem = "verify.publicKeySecretRef of the template: Secret ns/k key cosign.pub: not found"
    acts, end = one_pass(world(verify_key_problem=problem, vms=(vm("aaaaaa"),)))
    assert acts.count == 0 and acts.sizing is None and acts.create == 0
    c = conds(end)
    assert (c["TemplateMissing"]["status"], c["TemplateMissing"]["reason"]) == (
        "True",
        "VerifyKeyMissing",
    )
    assert problem in c["TemplateMissing"]["message"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "TemplateMissing")
    assert end.requeue == 30.0
    assert reasons(end) == ["TemplateMissing"]


# --------------------------------------------------------------------------------------------
# Names


@given(
    st.text("abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=63),
    st.uuids(),
    st.integers(0, 16**6 - 1),
)
def test_runner_names_fit_github_and_stay_the_pools(name: str, uid: Any, n: int) -> None:
    pool = "p" + name[1:]  # a name starts with an alphanumeric character
    prefix = runner_prefix(pool, str(uid))
    full = vm_name(prefix, f"{n:06x}")
    assert len(full) <= MAX_RUNNER_NAME
    assert owns_runner_name(prefix, full)
    assert owns_runner_name(prefix, prefix + "orphan1")  # a leftover with the prefix is ours
    assert prefix[-7:-1] == "-" + str(uid).replace("-", "")[:5]
    # stable: the same pool always has the same prefix (the orphan sweep relies on it)
    assert runner_prefix(pool, str(uid)) == prefix


def test_overlapping_and_equal_pool_names_never_own_each_others_runners() -> None:
    a = runner_prefix("ci", "0a1b2000-0000")
    b = runner_prefix("ci-0a1b2", "3c4d5000-0000")  # a runner of b starts with a's prefix
    assert not owns_runner_name(a, vm_name(b, "123456"))
    c = runner_prefix("ci-0a1b2-x", "6e7f8000-0000")
    assert not owns_runner_name(a, vm_name(c, "abcdef"))
    long = "x" * 63
    in_ns1, in_ns2 = runner_prefix(long, "11111-aaa"), runner_prefix(long, "22222-bbb")
    assert in_ns1 != in_ns2 and len(vm_name(in_ns1, "abcdef")) == 64
    assert runner_prefix("a" * 50 + ".b", "12345").endswith("a-12345-")  # no ".-" in the name


# --------------------------------------------------------------------------------------------
# GitHub errors


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (
            GitHubFailure(kind=FailureKind.CREDENTIALS_ERROR, message="m"),
            ("CredentialsInvalid", "CredentialsError"),
        ),
        (
            GitHubFailure(kind=FailureKind.BAD_CREDENTIALS, message="m"),
            ("CredentialsInvalid", "BadCredentials"),
        ),
        (
            GitHubFailure(kind=FailureKind.PERMISSION_NOT_GRANTED, message="m"),
            ("CredentialsInvalid", "PermissionNotGranted"),
        ),
        (
            GitHubFailure(
                kind=FailureKind.RATE_LIMITED, message="m", rate_kind="secondary", retry_after=60
            ),
            ("RateLimited", "SecondaryRateLimit"),
        ),
        (
            GitHubFailure(
                kind=FailureKind.INSTALLATION_UNAVAILABLE, message="m", unavailable_reason="removed"
            ),
            ("GitHubUnavailable", "InstallationUnavailable"),
        ),
        (
            GitHubFailure(kind=FailureKind.TRANSIENT, message="m"),
            ("GitHubUnavailable", "TransientError"),
        ),
        (GitHubFailure(kind=FailureKind.NOT_FOUND, message="m"), ("GitHubUnavailable", "NotFound")),
        (GitHubFailure(kind=FailureKind.REQUEST_REJECTED, message="m"), None),
    ],
)
def test_github_error_to_condition(
    failure: GitHubFailure, expected: tuple[str, str] | None
) -> None:
    got = github_condition(failure)
    assert (got[:2] if got else None) == expected


def test_listing_failure_sets_the_condition_backs_off_and_decides_nothing_github_based() -> None:
    failure = GitHubFailure(
        kind=FailureKind.TRANSIENT, message="GitHub 502 on /orgs/{org}/actions/runners"
    )
    w = world(
        (vm("aaaaaa", phase="Succeeded", runner=(7, False, False)), vm("bbbbbb")),
        None,
        github=GitHubView(connected=True, failure=failure),
    )
    acts, end = one_pass(w)
    assert [d.name for d in acts.deletions] == [PREFIX + "aaaaaa"]  # terminal only
    assert acts.create == 0 and not acts.mints and not acts.use_github
    c = conds(end)
    assert (c["GitHubUnavailable"]["status"], c["GitHubUnavailable"]["reason"]) == (
        "True",
        "TransientError",
    )
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "TransientError")
    assert reasons(end) == ["GitHubError"]
    backoff = end.memory.backoff
    assert backoff.failures == 1 and not backoff.ready(MONO)
    assert end.requeue <= backoff.not_before - MONO


def test_rate_limit_waits_for_the_reset_and_says_when() -> None:
    failure = GitHubFailure(
        kind=FailureKind.RATE_LIMITED,
        message="GitHub primary rate limit",
        rate_kind="primary",
        retry_after=3600,
    )
    _, end = one_pass(world(github=GitHubView(connected=True, failure=failure)))
    c = conds(end)
    assert (c["RateLimited"]["status"], c["RateLimited"]["reason"]) == ("True", "PrimaryRateLimit")
    assert "resets 2026-03-01T13:00:00Z" in c["RateLimited"]["message"]
    assert end.memory.backoff.not_before >= MONO + 3600
    assert end.requeue == PassSettings().resync_seconds  # passes go on; GitHub waits


def test_a_rate_limit_answer_clears_an_earlier_unavailable() -> None:
    """GitHub answering with a rate limit is GitHub answering: the 5xx condition of an earlier
    pass does not stay True beside RateLimited until a list succeeds."""
    down = GitHubFailure(kind=FailureKind.TRANSIENT, message="GitHub 502 on /orgs/{org}/runners")
    _, first = one_pass(world(github=GitHubView(connected=True, failure=down)))
    assert conds(first)["GitHubUnavailable"]["status"] == "True"
    limited = GitHubFailure(
        kind=FailureKind.RATE_LIMITED,
        message="GitHub primary rate limit",
        rate_kind="primary",
        retry_after=60,
    )
    pool = pool_obj(status={"conditions": list(conds(first).values())})
    _, end = one_pass(world(pool=pool, github=GitHubView(connected=True, failure=limited)))
    c = conds(end)
    assert c["RateLimited"]["status"] == "True"
    assert (c["GitHubUnavailable"]["status"], c["GitHubUnavailable"]["reason"]) == (
        "False",
        "Available",
    )


def test_a_missing_key_is_a_credentials_event_not_a_github_error() -> None:
    failure = GitHubFailure(
        kind=FailureKind.CREDENTIALS_ERROR, message="credentials Secret lacks key 'k'"
    )
    _, end = one_pass(world(github=GitHubView(failure=failure)))
    assert reasons(end) == ["CredentialsInvalid"]
    assert conds(end)["Ready"]["reason"] == "CredentialsError"


def test_while_backing_off_nothing_is_asked_of_github() -> None:
    backoff = BackoffState(failures=2, not_before=MONO + 3, last_error="boom")
    w = remembering(
        world((), None, github=GitHubView(connected=True, skipped=True)), backoff=backoff
    )
    acts, end = one_pass(w)
    assert acts.use_github is False and acts.create == 0
    c = conds(end)
    assert (c["Ready"]["reason"], c["Ready"]["message"]) == ("GitHubBackoff", "boom; retry in 3s")
    assert "CredentialsInvalid" not in c  # not touched: as it was stored


def test_mint_failure_outcome_reports_jit_mint_failed() -> None:
    w = world()
    acts = pool_acts(w)
    assert acts.create == 1
    f = GitHubFailure(
        kind=FailureKind.REQUEST_REJECTED, message="GitHub 422 on /jit", vm=PREFIX + "abcdef"
    )
    end = conclude_pass(w, acts, ActsDone(created=1, failure=f))
    c = conds(end)
    assert c["GitHubUnavailable"]["status"] == "False"  # rejected: GitHub is not down
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "JitMintFailed")
    assert "RequestRejected" in c["Ready"]["message"] and "retry in" in c["Ready"]["message"]
    assert [e.reason for e in end.events] == ["GitHubError", "ScaledUp"]
    assert status(end)["starting"] == 1 and status(end)["total"] == 1
    assert not end.memory.backoff.ready(MONO)


def test_secret_write_failure_backs_off_like_github() -> None:
    w = world()
    done = ActsDone(created=1, secret_write_failed="JIT Secret x (HTTP 403)")
    end = conclude_pass(w, pool_acts(w), done)
    c = conds(end)
    assert (c["Ready"]["reason"], c["Ready"]["message"]) == (
        "SecretWriteFailed",
        "JIT Secret x (HTTP 403)",
    )
    assert "SecretWriteFailed" in reasons(end)
    assert not end.memory.backoff.ready(MONO)


def test_success_clears_the_github_conditions_and_the_backoff() -> None:
    w = remembering(world(), backoff=BackoffState(failures=3, not_before=MONO - 1, last_error="x"))
    _, end = one_pass(w)
    c = conds(end)
    assert all(
        c[t]["status"] == "False"
        for t in ("CredentialsInvalid", "GitHubUnavailable", "RateLimited")
    )
    assert c["Ready"]["status"] == "True"
    assert end.memory.backoff.failures == 0


# --------------------------------------------------------------------------------------------
# Polling


def polling_pool(**kw: Any) -> Any:
    return pool_obj(mode="polling", polling={"enabled": True, "intervalSeconds": 30}, **kw)


def test_poll_schedule_by_mode() -> None:
    assert poll_wanted(world(pool=pool_obj())) is None  # manual
    first = world(pool=polling_pool())
    assert poll_wanted(first) is not None
    assert poll_first(first) is not None  # the first phase: poll, then decide
    recent = remembering(first, poll=PollState(MONO - 10))
    assert poll_wanted(recent) is None
    assert poll_wanted(remembering(first, poll=PollState(MONO - 30))) is not None
    # a runner became busy: a queued job was taken, poll again at once
    busy = dataclasses.replace(
        recent, github=GitHubView(connected=True, runners=(reg(1, "aaaaaa", busy=True),))
    )
    assert poll_wanted(busy) == "a runner became busy since the last poll"
    # once polled this pass, never twice
    done = polled(first, PollOutcome(time=NOW, queued=2, api_calls=3), pending=2)
    assert poll_wanted(done) is None and poll_first(done) is None
    assert status(one_pass(done)[1])["lastPoll"] == {
        "time": "2026-03-01T12:00:00Z",
        "queuedJobs": 2,
        "apiCalls": 3,
    }


def test_a_vanished_registration_without_a_job_record_asks_for_a_poll_once() -> None:
    """A running VM whose registration vanished may have run a short job between two runner
    lists (GitHub removes an ephemeral runner after its job): the pass polls before it takes
    the VM for broken, and asks about that runner once."""
    running = vm("aaaaaa", runner=(1, True, False))
    w = remembering(world((running,), (), pool=polling_pool()), poll=PollState(MONO - 5))
    ask = poll_first(w)
    assert ask is not None and ask.since == MONO and ask.vanished == {PREFIX + "aaaaaa"}
    assert "vanished" in ask.why
    asked = remembering(w, poll=PollState(MONO - 5, vanished_at_poll=ask.vanished))
    assert poll_first(asked) is None
    job = Job(
        id=5,
        run_id=6,
        repository="octo/app",
        labels=("imp",),
        status="completed",
        seen_at=ago(3),
        runner_name=PREFIX + "aaaaaa",
        started_at=ago(2),
    )
    known = dataclasses.replace(w, finished_jobs={PREFIX + "aaaaaa": job})
    assert poll_first(known) is None  # the job record tells: no poll needed
    assert not poll_first(remembering(world((running,), ()), poll=PollState(MONO - 5)))  # manual


def test_webhook_mode_safety_poll_period_is_the_setting() -> None:
    hook = pool_obj(mode="webhook", webhook={"secretRef": {"name": "hook"}})
    s = PassSettings(webhook_safety_poll_seconds=120)
    w = world(pool=hook, settings=s)
    assert poll_wanted(w) == "first poll since the operator started"
    assert poll_wanted(remembering(w, poll=PollState(MONO - 119))) is None
    why = poll_wanted(remembering(w, poll=PollState(MONO - 120)))
    assert why is not None and "safety poll every 120s" in why


def test_a_poll_request_says_from_when_a_shared_poll_answers_it() -> None:
    """Pools of one installation share polls: a request is answered by a poll that started
    when it fell due (or later), and the pool's last poll becomes that poll's start."""
    first = world(pool=polling_pool())
    # the first: a poll that started since this pass began (not one from before the pool's
    # route was published, which deliveries in between did not reach)
    assert poll_first(first) == PollRequest("first poll since the operator started", MONO)
    due = remembering(first, poll=PollState(MONO - 45))
    req = poll_first(due)
    assert req is not None and req.since == MONO - 15  # due 15 s ago: a poll since then serves
    busy = dataclasses.replace(
        remembering(first, poll=PollState(MONO - 10)),
        github=GitHubView(connected=True, runners=(reg(1, "aaaaaa", busy=True),)),
    )
    assert poll_since(busy) == MONO  # the queue changed now: only a new poll will do
    shared = polled(first, PollOutcome(time=NOW, started=MONO - 3))
    assert shared.memory.poll.last_poll == MONO - 3


def test_webhook_mode_polls_again_until_the_first_sweep_read_every_repository() -> None:
    hook = pool_obj(mode="webhook", webhook={"secretRef": {"name": "hook"}})
    w = world(pool=hook, settings=PassSettings(resync_seconds=10))
    partial = polled(w, PollOutcome(time=NOW, started=MONO, swept=False))
    assert not partial.memory.poll.swept
    later = dataclasses.replace(partial, mono=MONO + 10, polled=None)
    assert poll_wanted(later) == (
        "the first poll has not read every repository yet (start-up sweep)"
    )
    assert poll_since(later) == MONO + 10
    done = remembering(later, poll=PollState(MONO, swept=True))
    assert poll_wanted(done) is None  # then only the safety poll


def poll_times(pool: Any, settings: PassSettings, horizon: float) -> list[float]:
    """When an idle pool (no VM, no demand) polls over ``horizon`` seconds when each pass runs
    at the time the last one asked for: the pure pass run as its daemon runs it."""
    mono, memory, out = MONO, None, []
    while mono < MONO + horizon:
        w = world(pool=pool, settings=settings, mono=mono, now=NOW + timedelta(seconds=mono - MONO))
        if memory is not None:
            w = dataclasses.replace(w, memory=memory)
        if poll_first(w) is not None:
            out.append(mono)
            w = polled(w, PollOutcome(time=w.now, started=mono))
        end = one_pass(w)[1]
        assert 0 < end.requeue <= settings.resync_seconds
        memory, mono = end.memory, mono + end.requeue
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(5, 90), st.sampled_from(["polling", "hybrid"]))
def test_an_idle_pool_polls_at_its_interval_not_at_the_next_resync(
    interval: int, mode: str
) -> None:
    """A pool at ``intervalSeconds: 5`` polled every 10 s (the idle resync), one at 12 s every
    20 s: the pass that ends asks to run again when its next poll falls due."""
    extra = {"webhook": {"secretRef": {"name": "hook"}}} if mode == "hybrid" else {}
    pool = pool_obj(
        mode=mode, minIdle=0, polling={"enabled": True, "intervalSeconds": interval}, **extra
    )
    times = poll_times(pool, PassSettings(), 4 * interval + 1)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) >= 3
    assert all(interval <= g <= interval + 0.05 for g in gaps), gaps


@settings(max_examples=30, deadline=None)
@given(st.integers(5, 700))
def test_the_webhook_safety_poll_keeps_its_period(safety: int) -> None:
    hook = pool_obj(mode="webhook", minIdle=0, webhook={"secretRef": {"name": "hook"}})
    times = poll_times(hook, PassSettings(webhook_safety_poll_seconds=safety), 2 * safety + 1)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps and all(safety <= g <= safety + 0.05 for g in gaps), gaps


def test_no_timed_poll_no_early_pass() -> None:
    """Manual pools, hybrid pools with polling disabled and a pool backing off keep their
    resync (or the backoff's end): nothing falls due."""
    for pool in (
        pool_obj(minIdle=0),
        pool_obj(
            mode="hybrid",
            minIdle=0,
            polling={"enabled": False, "intervalSeconds": 5},
            webhook={"secretRef": {"name": "hook"}},
        ),
    ):
        w = remembering(world(pool=pool), poll=PollState(MONO - 1))
        assert one_pass(w)[1].requeue == PassSettings().resync_seconds
    skipped = GitHubView(connected=True, skipped=True, runners=None)  # the pass kept off GitHub
    backing_off = remembering(
        world(pool=polling_pool(minIdle=0), github=skipped),
        poll=PollState(MONO - 29),
        backoff=BackoffState(failures=3, not_before=MONO + 8),
    )
    assert one_pass(backing_off)[1].requeue == 8


def test_low_budget_pauses_polling_not_minting() -> None:
    budget = RateBudget(limit=5000, remaining=100, reset=1772370000)
    w = world(pool=polling_pool(), github=GitHubView(connected=True, runners=(), budget=budget))
    assert poll_first(w) is None
    acts, end = one_pass(w)
    assert acts.create == 1  # minting goes on
    c = conds(end)
    assert (c["RateLimited"]["status"], c["RateLimited"]["reason"]) == ("True", "BudgetLow")
    assert end.memory.poll.last_poll == MONO


def test_poll_failure_is_shown_and_blocks_github_work() -> None:
    f = GitHubFailure(kind=FailureKind.TRANSIENT, message="GitHub 502 on runs")
    w = polled(world(pool=polling_pool()), PollOutcome(time=NOW, failure=f))
    acts, end = one_pass(w)
    assert acts.create == 0 and not acts.use_github
    assert status(end)["lastPoll"]["error"] == "TransientError: GitHub 502 on runs"
    assert conds(end)["Ready"]["reason"] == "GitHubBackoff"


# --------------------------------------------------------------------------------------------
# Lost nodes


def lease(node: str, renewed: float | None) -> NodeLease:
    return NodeLease(
        node=node, renewed_at=ago(renewed) if renewed is not None else None, duration_seconds=40
    )


def test_vms_on_lost_nodes_are_failed_and_replaced_in_the_same_pass() -> None:
    vms = (
        vm("aaaaaa", node="dead", runner=(1, True, False)),
        vm("bbbbbb", node="alive", runner=(2, True, False)),
        vm("cccccc", node="dead", deleting=True, finalizers=(AGENT_FINALIZER, "x")),
        vm("dddddd", node="never-seen"),
    )
    runners = (reg(1, "aaaaaa"), reg(2, "bbbbbb"))
    leases = (
        lease("dead", 200),
        lease("alive", 5),
        lease("alive", 10_000),
    )  # one live Lease is enough
    acts = pool_acts(world(vms, runners, leases=leases))
    assert sorted(p.name for p in acts.lost) == [PREFIX + "aaaaaa", PREFIX + "dddddd"]
    p = acts.lost[0]
    assert wire(p.status)["phase"] == "Failed" and p.status.exit_reason == "NodeLost"
    assert p.event is not None and p.event.warning
    (rel,) = acts.releases
    assert rel.name == PREFIX + "cccccc" and rel.finalizers == ("x",)
    # failed now, so deleted now as terminal (each runner is single-use) and replaced
    deleted = {d.name for d in acts.deletions}
    assert {PREFIX + "aaaaaa", PREFIX + "dddddd"} <= deleted and PREFIX + "bbbbbb" not in deleted


# --------------------------------------------------------------------------------------------
# VM records


def test_runner_records_follow_github_and_a_vanished_registration_is_offline() -> None:
    vms = (
        vm("aaaaaa", runner=(1, False, False)),
        vm("bbbbbb", runner=(2, True, False), job=9),  # busy: kept although its registration went
    )
    acts = pool_acts(world(vms, (reg(1, "aaaaaa", online=True),)))
    by = {p.name: wire(p.status) for p in acts.records}
    assert by[PREFIX + "aaaaaa"] == {
        "runner": {"id": 1, "name": PREFIX + "aaaaaa", "online": True, "busy": False},
        # first seen online: when, and the registration time it took (created 10 s ago)
        "timings": {"createdAt": "2026-03-01T11:59:50Z", "runnerOnlineAt": "2026-03-01T12:00:00Z"},
    }
    observed = {p.name: p.observe for p in acts.records}
    assert observed[PREFIX + "aaaaaa"] == (("runnerRegistration", 10.0),)
    assert by[PREFIX + "bbbbbb"] == {"runner": {"online": False, "busy": False}}


def _job(status: str = "in_progress", **kw: Any) -> Job:
    fields: dict[str, Any] = dict(
        id=77,
        run_id=5,
        repository="octo/app",
        labels=("imp",),
        status=status,
        seen_at=ago(10),
        runner_name=PREFIX + "aaaaaa",
        started_at=ago(3),
    )
    return Job(**(fields | kw))


def test_the_job_a_runner_took_is_recorded_once() -> None:
    job = _job()
    w = world(
        (vm("aaaaaa", runner=(1, True, True)),),
        (reg(1, "aaaaaa", busy=True),),
        running_jobs={PREFIX + "aaaaaa": job},
    )
    (patch,) = [p for p in pool_acts(w).records if p.status.job is not None]
    assert wire(patch.status) == {
        "job": {
            "id": 77,
            "workflowRunId": 5,
            "repository": "octo/app",
            "startedAt": "2026-03-01T11:59:57Z",
        },
        "timings": {
            "jobQueuedAt": "2026-03-01T11:59:50Z",
            "jobStartedAt": "2026-03-01T11:59:57Z",
        },
    }
    assert patch.observe == (("jobPickup", 7.0),) and job.wait_seconds == 7.0
    recorded = dataclasses.replace(w, vms=(vm("aaaaaa", runner=(1, True, True), job=77),))
    assert [p for p in pool_acts(recorded).records if p.status.job is not None] == []


def test_a_runner_that_took_its_job_between_two_lists_is_busy_and_its_start_its_readiness() -> None:
    """GitHub's list still shows the runner idle (or not at all) while the job record names it:
    the record wins. A runner never seen online is ready when its job started."""
    unseen = vm("aaaaaa", runner=(1, False, False))
    w = world((unseen,), (reg(1, "aaaaaa", online=True),), running_jobs={PREFIX + "aaaaaa": _job()})
    acts, end = one_pass(w)
    assert (status(end)["busy"], status(end)["idle"]) == (1, 0)
    (patch,) = acts.records
    timings = wire(patch.status)["timings"]
    assert timings["runnerOnlineAt"] == "2026-03-01T11:59:57Z"  # the job's start
    assert ("runnerRegistration", 7.0) in patch.observe


def test_a_vm_whose_job_completed_is_neither_supply_nor_replaced() -> None:
    """Its runner ran its one job and is gone from GitHub's list, the agent has not reported
    the VM Succeeded yet: it is winding down (no replacement, no deletion, not idle)."""
    done = vm("aaaaaa", runner=(1, True, False))
    finished = _job("completed", completed_at=ago(1))
    w = world((done,), (), pool=pool_obj(minIdle=0), finished_jobs={PREFIX + "aaaaaa": finished})
    acts, end = one_pass(w)
    assert acts.deletions == () and acts.create == 0
    st = status(end)
    assert (st["idle"], st["busy"], st["starting"], st["total"]) == (0, 0, 0, 1)
    (patch,) = acts.records
    assert wire(patch.status)["job"]["completedAt"] == "2026-03-01T11:59:59Z"
    # the same VM without the job record: a vanished registration, replaced as before
    acts = pool_acts(dataclasses.replace(w, finished_jobs={}))
    assert [d.name for d in acts.deletions] == [PREFIX + "aaaaaa"]


def test_idle_runners_stay_idle_while_the_runner_list_cannot_be_read() -> None:
    vms = (
        vm("aaaaaa", runner=(1, True, False)),
        vm("bbbbbb", runner=(2, True, True)),
        vm("cccccc"),
    )
    failure = GitHubFailure(
        kind=FailureKind.RATE_LIMITED, message="limited", rate_kind="secondary", retry_after=60
    )
    acts, end = one_pass(world(vms, None, github=GitHubView(connected=True, failure=failure)))
    st = status(end)
    assert (st["idle"], st["busy"], st["starting"]) == (1, 1, 1)
    assert acts.records == ()  # nothing is copied from a list that was not read


# --------------------------------------------------------------------------------------------
# Demand annotation and webhook Secret


def test_a_bad_demand_annotation_is_reported_and_ignored() -> None:
    _, end = one_pass(world(pool=pool_obj(annotations={"imp.dev/runner-demand": "lots"})))
    assert "InvalidDemand" in reasons(end)
    assert status(end)["pendingJobs"] == 0


def test_a_missing_webhook_secret_is_an_event() -> None:
    _, end = one_pass(world(webhook_secret_missing="hook"))
    (ev,) = [e for e in end.events if e.reason == "WebhookSecretMissing"]
    assert ev.warning and "'hook'" in ev.message


# --------------------------------------------------------------------------------------------
# Template roll-out


def outdated(suffix: str, **kw: Any) -> Any:
    return vm(suffix, image=NEW_IMAGE, **kw)  # made from an image the template no longer names


def test_rollout_makes_replacements_first_and_keeps_min_idle_ready() -> None:
    """The first pass of a roll-out (the passes after it run against the real executor in
    tests/operator/test_pool_rollout.py): no outdated VM is supply, so replacements are made;
    none goes while only minIdle idle runners are ready."""
    vms = (
        outdated("aaaaaa", runner=(1, True, False), created=30),
        outdated("bbbbbb", runner=(2, True, False), created=20),
        outdated("cccccc", runner=(3, True, True), created=10),
    )
    runners = (reg(1, "aaaaaa"), reg(2, "bbbbbb"), reg(3, "cccccc", busy=True))
    w = world(vms, runners, pool=pool_obj(minIdle=2, scaleUpStep=1, maxConcurrent=10))
    acts, end = one_pass(w)
    assert status(end)["outdated"] == 3
    # desired = busy 1 + minIdle 2 = 3; supply counts only the busy one: replacements first
    assert acts.create == 1
    assert acts.deletions == ()  # 2 idle, minIdle 2: none can go yet


def test_rollout_deletions_are_outdated_reason_and_deregister_first() -> None:
    vms = (outdated("aaaaaa", runner=(1, True, False)), vm("bbbbbb", runner=(2, True, False)))
    acts = pool_acts(world(vms, (reg(1, "aaaaaa"), reg(2, "bbbbbb")), pool=pool_obj(minIdle=1)))
    assert acts.sizing is not None
    (d,) = [d for d in acts.sizing.delete_vms if d.reason is Reason.OUTDATED]
    assert d.name == PREFIX + "aaaaaa" and d.deregister_first
    assert acts.create == 0  # the current idle VM already meets minIdle


def test_a_class_resize_makes_vms_outdated() -> None:
    bigger = dataclasses.replace(CLASS, spec=CLASS.spec.model_copy(update={"vcpu": 4}))
    w = world((vm("aaaaaa", runner=(1, True, False)),), (reg(1, "aaaaaa"),))
    assert status(one_pass(w)[1])["outdated"] == 0
    assert status(one_pass(dataclasses.replace(w, vm_class=bigger))[1])["outdated"] == 1


# --------------------------------------------------------------------------------------------
# Properties


SUFFIXES = [f"{i:06x}" for i in range(1, 9)]


@st.composite
def worlds(draw: st.DrawFn) -> Any:
    n = draw(st.integers(0, 6))
    vms, runners = [], []
    for i, suffix in enumerate(SUFFIXES[:n]):
        phase = draw(st.sampled_from([None, "Pending", "Running", "Succeeded", "Failed"]))
        # GitHub reports a finished VM's runner busy only for a moment: not in a static world
        kinds = ["none", "offline", "idle"] + ([] if phase in ("Succeeded", "Failed") else ["busy"])
        kind = draw(st.sampled_from(kinds))
        rid = 100 + i
        recorded = None if kind == "none" else (rid, kind in ("idle", "busy"), kind == "busy")
        old = draw(st.booleans())
        vms.append(
            vm(
                suffix,
                phase=phase,
                runner=recorded,
                secret=draw(st.booleans()) or kind != "none",
                created=draw(st.sampled_from([5, 100, 1000])),
                image=NEW_IMAGE if old else IMAGE,
                job=7 if kind == "busy" and draw(st.booleans()) else None,
            )
        )
        if kind != "none":
            runners.append(reg(rid, suffix, online=kind in ("idle", "busy"), busy=kind == "busy"))
    if draw(st.booleans()):
        runners.append(reg(999, "ffffff", online=draw(st.booleans())))  # a registration without VM
    last_up = draw(st.sampled_from([None, 10, 1000]))
    status = (
        {"lastScaleUpTime": f"{(NOW - timedelta(seconds=last_up)).isoformat()}"}
        if last_up
        else None
    )
    pool = pool_obj(
        status=status,
        minIdle=draw(st.integers(0, 3)),
        maxConcurrent=draw(st.integers(0, 8)),
        scaleUpStep=draw(st.integers(1, 3)),
        cooldownSeconds=draw(st.sampled_from([0, 30, 300])),
        annotations=None,
    )
    return world(tuple(vms), tuple(runners), pool=pool, pending_jobs=draw(st.integers(0, 3)))


@settings(max_examples=150, deadline=None)
@given(worlds())
def test_no_vm_is_both_minted_and_deleted_and_mints_have_their_vm(w: Any) -> None:
    """The acts of one pass never mint a JIT config for a VM they delete, mint only for VMs of
    the pool, and record only VMs that stay."""
    acts = pool_acts(w)
    minted = {m.vm for m in acts.mints}
    deleted = {d.name for d in acts.deletions}
    assert not minted & deleted
    assert minted <= {v.name for v in w.vms}
    assert not {r.name for r in acts.records} & deleted


@settings(max_examples=100, deadline=None)
@given(worlds(), st.randoms(use_true_random=False))
def test_conditions_and_status_are_a_function_of_the_world(w: Any, rnd: random.Random) -> None:
    _, a = one_pass(w)
    runners = w.github.runners
    shuffled = dataclasses.replace(
        w,
        vms=tuple(rnd.sample(list(w.vms), len(w.vms))),
        github=dataclasses.replace(
            w.github, runners=tuple(rnd.sample(list(runners), len(runners)))
        ),
    )
    _, b = one_pass(shuffled)
    assert a.conditions == b.conditions
    assert a.status == b.status
    assert one_pass(w) == one_pass(w)  # deterministic


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 600), st.integers(0, 1200))
def test_cooldown_is_honoured(cooldown: int, since: int) -> None:
    """Two idle runners, minIdle 0: both surplus; removed only once ``cooldownSeconds`` have
    passed since the last scale-up."""
    status = {"lastScaleUpTime": (NOW - timedelta(seconds=since)).isoformat()}
    vms = (vm("aaaaaa", runner=(1, True, False)), vm("bbbbbb", runner=(2, True, False)))
    w = world(
        vms,
        (reg(1, "aaaaaa"), reg(2, "bbbbbb")),
        pool=pool_obj(status=status, minIdle=0, cooldownSeconds=cooldown),
    )
    removed = {d.name for d in pool_acts(w).deletions}
    assert removed == (set() if since < cooldown else {v.name for v in vms})


@settings(max_examples=100, deadline=None)
@given(st.floats(-100, 100), st.floats(0, 0.999))
def test_backoff_is_honoured(until: float, jitter: float) -> None:
    """While the backoff runs, no JIT config is minted and no VM created; after it, both."""
    w = world((vm("aaaaaa", secret=False, created=5),), (), jitter=jitter)
    acts = pool_acts(remembering(w, backoff=BackoffState(1, MONO + until, "x")))
    waiting = MONO + until > MONO
    assert acts.use_github is not waiting
    if waiting:
        assert acts.create == 0 and acts.mints == ()
    else:
        assert [m.vm for m in acts.mints] == [PREFIX + "aaaaaa"]


@settings(max_examples=100, deadline=None)
@given(st.integers(30, 900), st.integers(0, 1800))
def test_bootstrap_timeout_is_honoured(timeout: int, age: int) -> None:
    """A VM whose runner never came online is replaced once older than the timeout."""
    pool = pool_obj(spec={"bootstrapTimeoutSeconds": timeout})
    w = world(
        (vm("aaaaaa", runner=(1, False, False), created=age),),
        (reg(1, "aaaaaa", online=False),),
        pool=pool,
    )
    deleted = [d for d in pool_acts(w).deletions if d.name == PREFIX + "aaaaaa"]
    assert bool(deleted) is (age > timeout)


@settings(max_examples=60, deadline=None)
@given(st.floats(0, 0.999), st.integers(1, 8))
def test_backoff_delays_double_with_full_jitter(jitter: float, failures: int) -> None:
    b = BackoffState(failures - 1, 0.0, "")
    nxt = b.failed(MONO, jitter, message="m")
    base = min(300.0, 2.0 * 2 ** (failures - 1))
    assert nxt.failures == failures
    assert base * 0.5 <= nxt.not_before - MONO <= base
    assert b.failed(MONO, jitter, message="m", at_least=900).not_before == MONO + 900


def test_vms_made_before_the_hash_annotation_compare_by_their_spec() -> None:
    same = vm("aaaaaa", runner=(1, True, False), annotated=False)
    old = vm("bbbbbb", runner=(2, True, False), annotated=False, image=NEW_IMAGE)
    _, end = one_pass(world((same, old), (reg(1, "aaaaaa"), reg(2, "bbbbbb"))))
    assert status(end)["outdated"] == 1


def node_lease(node: str, used_vcpu: int, used_mem: int) -> NodeLease:
    annotations = {
        "imp.dev/vcpu": "4",
        "imp.dev/memory-mib": "4096",
        "imp.dev/vcpu-used": str(used_vcpu),
        "imp.dev/memory-mib-used": str(used_mem),
    }
    return NodeLease.parse(node, ago(3), 40, annotations)


def conditions_of(done: Any) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in done.conditions}


def test_unbound_vm_that_fits_on_no_node_makes_the_pool_unschedulable() -> None:
    vms = (vm("aaaaaa", phase=None, created=60), vm("bbbbbb", phase=None, created=2))
    w = world(vms, (), leases=(node_lease("node-1", 3, 1024),))
    done = conclude_pass(w, pool_acts(w), ActsDone())
    cond = conditions_of(done)["Unschedulable"]
    assert (cond["status"], cond["reason"]) == ("True", "InsufficientCapacity")
    # only the VM unclaimed for long enough counts; the class needs 2 vCPU, 2048 MiB
    assert cond["message"] == (
        "1 VM(s) wait for a node: each needs 2 vCPU, 2048 MiB; node-1 1/4 vCPU, 3072/4096 MiB free"
    )
    (ev,) = [e for e in done.events if e.reason == "Unschedulable"]
    assert ev.warning and ev.message == cond["message"]
    # capacity freed: the condition clears, without another Event
    w2 = world(
        vms,
        (),
        leases=(node_lease("node-1", 0, 0),),
        pool=pool_obj(status={"conditions": list(done.conditions)}),
    )
    done2 = conclude_pass(w2, pool_acts(w2), ActsDone())
    cond2 = conditions_of(done2)["Unschedulable"]
    assert (cond2["status"], cond2["reason"]) == ("False", "Schedulable")
    assert not [e for e in done2.events if e.reason == "Unschedulable"]


def test_vms_under_tcg_make_the_pool_emulated_and_kvm_clears_it() -> None:
    def agent(node: str, accel: str) -> NodeLease:
        notes = {"imp.dev/vcpu": "4", "imp.dev/memory-mib": "8192", "imp.dev/accelerator": accel}
        return NodeLease.parse(node, ago(3), 40, notes)

    vms = (vm("aaaaaa", node="node-1"),)
    w = world(vms, (), leases=(agent("node-1", "tcg/microvm"), agent("node-2", "kvm/microvm")))
    done = conclude_pass(w, pool_acts(w), ActsDone())
    cond = conditions_of(done)["Emulated"]
    assert (cond["status"], cond["reason"]) == ("True", "NoKVM")
    assert "on node-1" in cond["message"] and "node-2" not in cond["message"]
    (ev,) = [e for e in done.events if e.reason == "Emulated"]
    assert ev.warning
    # no VM on a node: judged on every agent with room; all on KVM clears it, without an Event
    prior = pool_obj(status={"conditions": list(done.conditions)})
    w2 = world((), (), leases=(agent("node-2", "kvm/microvm"),), pool=prior)
    done2 = conclude_pass(w2, pool_acts(w2), ActsDone())
    assert conditions_of(done2)["Emulated"]["status"] == "False"
    assert not [e for e in done2.events if e.reason == "Emulated"]
    # the process runtime (no QEMU) says nothing either way
    w3 = world((), (), leases=(agent("node-3", "none"),))
    assert "Emulated" not in conditions_of(conclude_pass(w3, pool_acts(w3), ActsDone()))


def test_no_agent_at_all_is_unschedulable() -> None:
    w = world((vm("aaaaaa", phase=None, created=60),), ())
    cond = conditions_of(conclude_pass(w, pool_acts(w), ActsDone()))["Unschedulable"]
    assert (cond["status"], cond["reason"]) == ("True", "NoAgents")
