"""The pure pool pass (impvm.scaling.poolpass): every decision the shell carries out, table tests
first, then properties over arbitrary worlds (idempotence, conditions a function of the world,
the clock honouring cooldown, backoff and bootstrap timeouts)."""

from __future__ import annotations

import dataclasses
import random
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.api.models import AGENT_FINALIZER, TEMPLATE_HASH_ANNOTATION
from impvm.scaling.jobtable import Job
from impvm.scaling.names import MAX_RUNNER_NAME, owns_runner_name, runner_prefix, vm_name
from impvm.scaling.nodes import NodeLease
from impvm.scaling.pool import Reason
from impvm.scaling.poolpass import (
    Outcome,
    PollRequest,
    PoolPlan,
    decide,
    github_condition,
    poll_since,
    poll_wanted,
    settle,
)
from impvm.scaling.world import (
    BackoffState,
    GitHubFailure,
    GitHubView,
    PassSettings,
    PollOutcome,
    PollState,
    RateBudget,
    VerifyKey,
)
from tests.scaling.poolworld import (
    CLASS,
    MONO,
    NEW_IMAGE,
    NOW,
    PREFIX,
    TEMPLATE,
    ago,
    apply,
    pool_obj,
    reg,
    vm,
    world,
)


def conds(plan: PoolPlan) -> dict[str, dict[str, Any]]:
    assert plan.settlement is not None
    return {c["type"]: dict(c) for c in plan.settlement.conditions}


def reasons(plan: PoolPlan) -> list[str]:
    assert plan.settlement is not None
    return [e.reason for e in plan.settlement.events]


# --------------------------------------------------------------------------------------------
# Template and class


def test_template_missing_blocks_everything_and_requeues_after_30s() -> None:
    plan = decide(world(template=None, vm_class=None, vms=(vm("aaaaaa", phase="Failed"),)))
    assert plan.acts == 0 and plan.sizing is None
    c = conds(plan)
    assert (c["TemplateMissing"]["status"], c["TemplateMissing"]["reason"]) == ("True", "NotFound")
    assert "'tpl' not found in namespace ns" in c["TemplateMissing"]["message"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "TemplateMissing")
    assert plan.settlement is not None and plan.settlement.requeue == 30.0
    assert reasons(plan) == ["TemplateMissing"]
    assert plan.settlement.status == {"observedGeneration": 3}

    # stored as such: the next pass sends no second Event and needs no write
    again = decide(apply(world(template=None, vm_class=None), plan))
    assert reasons(again) == [] and again.settlement is not None and not again.settlement.write


def test_class_missing_names_the_class() -> None:
    c = conds(decide(world(vm_class=None)))
    assert c["TemplateMissing"]["reason"] == "ClassNotFound"
    assert "'small'" in c["TemplateMissing"]["message"]


def test_found_template_clears_the_condition_and_shapes_new_vms() -> None:
    w = world(pool=pool_obj(spec={"runnerLayer": "r@sha256:" + "9" * 64, "expireAfter": "2h"}))
    plan = decide(w)
    assert conds(plan)["TemplateMissing"]["status"] == "False"
    assert plan.new_vm is not None
    assert plan.new_vm.spec == {
        "classRef": {"name": "small"},
        "image": TEMPLATE.spec.image,
        "lifecycle": "ephemeral",
        "runnerLayer": "r@sha256:" + "9" * 64,  # the pool's layer wins over the template's
        "expireAfter": "2h",
    }
    assert plan.new_vm.labels == {"imp.dev/runner-pool": "pool"}
    assert len(plan.new_vm.annotations[TEMPLATE_HASH_ANNOTATION]) == 16


PEM = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"


def test_a_signing_key_goes_onto_new_vms_and_into_the_template_hash() -> None:
    key = VerifyKey(pem=PEM, fingerprint="sha256:" + "a" * 64)
    unsigned = decide(world())
    signed = decide(world(verify_key=key))
    assert signed.new_vm is not None and unsigned.new_vm is not None
    assert signed.new_vm.spec["verify"] == {"publicKey": PEM}
    assert "verify" not in unsigned.new_vm.spec
    h = TEMPLATE_HASH_ANNOTATION
    assert signed.new_vm.annotations[h] != unsigned.new_vm.annotations[h]
    # a rotated key makes the idle VMs made with the old one outdated (they roll)
    w = world((vm("aaaaaa", runner=(1, True, False)),), (reg(1, "aaaaaa"),), verify_key=key)
    made = apply(w, decide(w))
    (old,) = [v for v in made.vms if v.name == PREFIX + "aaaaaa"]
    old = dataclasses.replace(
        old, annotations={h: signed.new_vm.annotations[h]}
    )  # made with the key
    w = dataclasses.replace(w, vms=(old,))
    assert decide(w).settlement.status["outdated"] == 0  # type: ignore[union-attr]
    rotated = dataclasses.replace(key, fingerprint="sha256:" + "b" * 64)
    w = dataclasses.replace(w, verify_key=rotated)
    assert decide(w).settlement.status["outdated"] == 1  # type: ignore[union-attr]


def test_an_unusable_signing_key_blocks_every_vm_and_requeues_after_30s() -> None:
    problem = "verify.publicKeySecretRef of the template: Secret ns/k key cosign.pub: not found"
    plan = decide(world(verify_key_problem=problem, vms=(vm("aaaaaa"),)))
    assert plan.acts == 0 and plan.sizing is None and plan.new_vm is None
    c = conds(plan)
    assert (c["TemplateMissing"]["status"], c["TemplateMissing"]["reason"]) == (
        "True",
        "VerifyKeyMissing",
    )
    assert problem in c["TemplateMissing"]["message"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "TemplateMissing")
    assert plan.settlement is not None and plan.settlement.requeue == 30.0
    assert reasons(plan) == ["TemplateMissing"]


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
            GitHubFailure(kind="CredentialsError", message="m"),
            ("CredentialsInvalid", "CredentialsError"),
        ),
        (
            GitHubFailure(kind="BadCredentials", message="m"),
            ("CredentialsInvalid", "BadCredentials"),
        ),
        (
            GitHubFailure(kind="PermissionNotGranted", message="m"),
            ("CredentialsInvalid", "PermissionNotGranted"),
        ),
        (
            GitHubFailure(kind="RateLimited", message="m", rate_kind="secondary", retry_after=60),
            ("RateLimited", "SecondaryRateLimit"),
        ),
        (
            GitHubFailure(
                kind="InstallationUnavailable", message="m", unavailable_reason="removed"
            ),
            ("GitHubUnavailable", "InstallationUnavailable"),
        ),
        (
            GitHubFailure(kind="TransientError", message="m"),
            ("GitHubUnavailable", "TransientError"),
        ),
        (GitHubFailure(kind="NotFound", message="m"), ("GitHubUnavailable", "NotFound")),
        (GitHubFailure(kind="RequestRejected", message="m"), None),
    ],
)
def test_github_error_to_condition(
    failure: GitHubFailure, expected: tuple[str, str] | None
) -> None:
    got = github_condition(failure)
    assert (got[:2] if got else None) == expected


def test_listing_failure_sets_the_condition_backs_off_and_decides_nothing_github_based() -> None:
    failure = GitHubFailure(
        kind="TransientError", message="GitHub 502 on /orgs/{org}/actions/runners"
    )
    w = world(
        (vm("aaaaaa", phase="Succeeded", runner=(7, False, False)), vm("bbbbbb")),
        None,
        github=GitHubView(connected=True, failure=failure),
    )
    plan = decide(w)
    assert [d.name for d in plan.deletions] == [PREFIX + "aaaaaa"]  # terminal only
    assert plan.create == 0 and not plan.mints and not plan.use_github
    c = conds(plan)
    assert (c["GitHubUnavailable"]["status"], c["GitHubUnavailable"]["reason"]) == (
        "True",
        "TransientError",
    )
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "TransientError")
    assert reasons(plan) == ["GitHubError"]
    s = plan.settlement
    assert s is not None and s.backoff.failures == 1 and not s.backoff.ready(MONO)
    assert s.requeue <= s.backoff.not_before - MONO


def test_rate_limit_waits_for_the_reset_and_says_when() -> None:
    failure = GitHubFailure(
        kind="RateLimited",
        message="GitHub primary rate limit",
        rate_kind="primary",
        retry_after=3600,
    )
    plan = decide(world(github=GitHubView(connected=True, failure=failure)))
    c = conds(plan)
    assert (c["RateLimited"]["status"], c["RateLimited"]["reason"]) == ("True", "PrimaryRateLimit")
    assert "resets 2026-03-01T13:00:00Z" in c["RateLimited"]["message"]
    s = plan.settlement
    assert s is not None and s.backoff.not_before >= MONO + 3600
    assert s.requeue == PassSettings().resync_seconds  # passes go on; GitHub waits


def test_a_rate_limit_answer_clears_an_earlier_unavailable() -> None:
    """GitHub answering with a rate limit is GitHub answering: the 5xx condition of an earlier
    pass does not stay True beside RateLimited until a list succeeds."""
    down = GitHubFailure(kind="TransientError", message="GitHub 502 on /orgs/{org}/runners")
    first = decide(world(github=GitHubView(connected=True, failure=down)))
    assert conds(first)["GitHubUnavailable"]["status"] == "True"
    limited = GitHubFailure(
        kind="RateLimited", message="GitHub primary rate limit", rate_kind="primary", retry_after=60
    )
    pool = pool_obj(status={"conditions": list(conds(first).values())})
    c = conds(decide(world(pool=pool, github=GitHubView(connected=True, failure=limited))))
    assert c["RateLimited"]["status"] == "True"
    assert (c["GitHubUnavailable"]["status"], c["GitHubUnavailable"]["reason"]) == (
        "False",
        "Available",
    )


def test_a_missing_key_is_a_credentials_event_not_a_github_error() -> None:
    failure = GitHubFailure(kind="CredentialsError", message="credentials Secret lacks key 'k'")
    plan = decide(world(github=GitHubView(failure=failure)))
    assert reasons(plan) == ["CredentialsInvalid"]
    assert conds(plan)["Ready"]["reason"] == "CredentialsError"


def test_while_backing_off_nothing_is_asked_of_github() -> None:
    backoff = BackoffState(failures=2, not_before=MONO + 3, last_error="boom")
    plan = decide(world((), None, github=GitHubView(connected=True, skipped=True), backoff=backoff))
    assert plan.use_github is False and plan.create == 0
    c = conds(plan)
    assert (c["Ready"]["reason"], c["Ready"]["message"]) == ("GitHubBackoff", "boom; retry in 3s")
    assert "CredentialsInvalid" not in c  # not touched: as it was stored


def test_mint_failure_outcome_reports_jit_mint_failed() -> None:
    w = world()
    plan = decide(w)
    assert plan.create == 1
    f = GitHubFailure(kind="RequestRejected", message="GitHub 422 on /jit", vm=PREFIX + "abcdef")
    done = settle(w, plan, Outcome(created=1, failure=f))
    c = {x["type"]: x for x in done.conditions}
    assert c["GitHubUnavailable"]["status"] == "False"  # rejected: GitHub is not down
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "JitMintFailed")
    assert "RequestRejected" in c["Ready"]["message"] and "retry in" in c["Ready"]["message"]
    assert [e.reason for e in done.events] == ["GitHubError", "ScaledUp"]
    assert done.status["starting"] == 1 and done.status["total"] == 1
    assert not done.backoff.ready(MONO)


def test_secret_write_failure_backs_off_like_github() -> None:
    w = world()
    done = settle(w, decide(w), Outcome(created=1, secret_write_failed="JIT Secret x (HTTP 403)"))
    c = {x["type"]: x for x in done.conditions}
    assert (c["Ready"]["reason"], c["Ready"]["message"]) == (
        "SecretWriteFailed",
        "JIT Secret x (HTTP 403)",
    )
    assert "SecretWriteFailed" in [e.reason for e in done.events]
    assert not done.backoff.ready(MONO)


def test_success_clears_the_github_conditions_and_the_backoff() -> None:
    w = world(backoff=BackoffState(failures=3, not_before=MONO - 1, last_error="x"))
    plan = decide(w)
    c = conds(plan)
    assert all(
        c[t]["status"] == "False"
        for t in ("CredentialsInvalid", "GitHubUnavailable", "RateLimited")
    )
    assert c["Ready"]["status"] == "True"
    assert plan.settlement is not None and plan.settlement.backoff.failures == 0


# --------------------------------------------------------------------------------------------
# Polling


def polling_pool(**kw: Any) -> Any:
    return pool_obj(mode="polling", polling={"enabled": True, "intervalSeconds": 30}, **kw)


def test_poll_schedule_by_mode() -> None:
    assert poll_wanted(world(pool=pool_obj())) is None  # manual
    first = world(pool=polling_pool())
    assert poll_wanted(first) is not None
    plan = decide(first)
    assert plan.poll is not None and plan.acts == 0  # poll first, nothing else
    recent = dataclasses.replace(first, poll=PollState(MONO - 10))
    assert poll_wanted(recent) is None
    assert poll_wanted(dataclasses.replace(first, poll=PollState(MONO - 30))) is not None
    # a runner became busy: a queued job was taken, poll again at once
    busy = dataclasses.replace(
        recent, github=GitHubView(connected=True, runners=(reg(1, "aaaaaa", busy=True),))
    )
    assert poll_wanted(busy) == "a runner became busy since the last poll"
    # once polled this pass, never twice
    polled = first.after_poll(PollOutcome(time=NOW, queued=2, api_calls=3), 2, {})
    assert poll_wanted(polled) is None
    assert decide(polled).settlement.status["lastPoll"] == {  # type: ignore[union-attr]
        "time": "2026-03-01T12:00:00Z",
        "queuedJobs": 2,
        "apiCalls": 3,
    }


def test_webhook_mode_safety_poll_period_is_the_setting() -> None:
    hook = pool_obj(mode="webhook", webhook={"secretRef": {"name": "hook"}})
    s = PassSettings(webhook_safety_poll_seconds=120)
    w = world(pool=hook, settings=s)
    assert poll_wanted(w) == "first poll since the operator started"
    assert poll_wanted(dataclasses.replace(w, poll=PollState(MONO - 119))) is None
    why = poll_wanted(dataclasses.replace(w, poll=PollState(MONO - 120)))
    assert why is not None and "safety poll every 120s" in why


def test_a_poll_request_says_from_when_a_shared_poll_answers_it() -> None:
    """Pools of one installation share polls: a request is answered by a poll that started
    when it fell due (or later), and the pool's last poll becomes that poll's start."""
    first = world(pool=polling_pool())
    assert decide(first).poll == PollRequest("first poll since the operator started", None)
    due = dataclasses.replace(first, poll=PollState(MONO - 45))
    req = decide(due).poll
    assert req is not None and req.since == MONO - 15  # due 15 s ago: a poll since then serves
    busy = dataclasses.replace(
        first,
        poll=PollState(MONO - 10),
        github=GitHubView(connected=True, runners=(reg(1, "aaaaaa", busy=True),)),
    )
    assert poll_since(busy) == MONO  # the queue changed now: only a new poll will do
    shared = first.after_poll(PollOutcome(time=NOW, started=MONO - 3), 0, {})
    assert shared.poll.last_poll == MONO - 3


def test_webhook_mode_polls_again_until_the_first_sweep_read_every_repository() -> None:
    hook = pool_obj(mode="webhook", webhook={"secretRef": {"name": "hook"}})
    w = world(pool=hook, settings=PassSettings(resync_seconds=10))
    partial = w.after_poll(PollOutcome(time=NOW, started=MONO, swept=False), 0, {})
    assert not partial.poll.swept
    later = dataclasses.replace(partial, mono=MONO + 10, polled=None)
    assert poll_wanted(later) == (
        "the first poll has not read every repository yet (start-up sweep)"
    )
    assert poll_since(later) == MONO + 10
    done = dataclasses.replace(later, poll=PollState(MONO, swept=True))
    assert poll_wanted(done) is None  # then only the safety poll


def test_low_budget_pauses_polling_not_minting() -> None:
    budget = RateBudget(limit=5000, remaining=100, reset=1772370000)
    w = world(pool=polling_pool(), github=GitHubView(connected=True, runners=(), budget=budget))
    plan = decide(w)
    assert plan.poll is None and plan.create == 1  # minting goes on
    c = conds(plan)
    assert (c["RateLimited"]["status"], c["RateLimited"]["reason"]) == ("True", "BudgetLow")
    assert plan.settlement is not None and plan.settlement.poll.last_poll == MONO


def test_poll_failure_is_shown_and_blocks_github_work() -> None:
    f = GitHubFailure(kind="TransientError", message="GitHub 502 on runs")
    w = world(pool=polling_pool()).after_poll(PollOutcome(time=NOW, failure=f), 0, {})
    plan = decide(w)
    assert plan.create == 0 and not plan.use_github
    s = plan.settlement
    assert s is not None and s.status["lastPoll"]["error"] == "TransientError: GitHub 502 on runs"
    assert conds(plan)["Ready"]["reason"] == "GitHubBackoff"


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
    plan = decide(world(vms, runners, leases=leases))
    assert sorted(p.name for p in plan.lost) == [PREFIX + "aaaaaa", PREFIX + "dddddd"]
    p = plan.lost[0]
    assert p.status["phase"] == "Failed" and p.status["exitReason"] == "NodeLost"
    assert p.event is not None and p.event.warning
    (rel,) = plan.releases
    assert rel.name == PREFIX + "cccccc" and rel.finalizers == ("x",)
    # failed now, so deleted now as terminal (each runner is single-use) and replaced
    deleted = {d.name for d in plan.deletions}
    assert {PREFIX + "aaaaaa", PREFIX + "dddddd"} <= deleted and PREFIX + "bbbbbb" not in deleted


# --------------------------------------------------------------------------------------------
# VM records


def test_runner_records_follow_github_and_a_vanished_registration_is_offline() -> None:
    vms = (
        vm("aaaaaa", runner=(1, False, False)),
        vm("bbbbbb", runner=(2, True, False), job=9),  # busy: kept although its registration went
    )
    plan = decide(world(vms, (reg(1, "aaaaaa", online=True),)))
    by = {p.name: dict(p.status) for p in plan.sync}
    assert by[PREFIX + "aaaaaa"] == {
        "runner": {"id": 1, "name": PREFIX + "aaaaaa", "online": True, "busy": False},
        # first seen online: when, and the registration time it took (created 10 s ago)
        "timings": {"createdAt": "2026-03-01T11:59:50Z", "runnerOnlineAt": "2026-03-01T12:00:00Z"},
    }
    observed = {p.name: p.observe for p in plan.sync}
    assert observed[PREFIX + "aaaaaa"] == (("runnerRegistration", 10.0),)
    assert by[PREFIX + "bbbbbb"] == {"runner": {"online": False, "busy": False}}


def test_the_job_a_runner_took_is_recorded_once() -> None:
    job = Job(
        id=77,
        run_id=5,
        repository="octo/app",
        labels=("imp",),
        status="in_progress",
        seen_at=ago(10),
        runner_name=PREFIX + "aaaaaa",
        started_at=ago(3),
    )
    w = world(
        (vm("aaaaaa", runner=(1, True, True)),),
        (reg(1, "aaaaaa", busy=True),),
        running_jobs={PREFIX + "aaaaaa": job},
    )
    (patch,) = [p for p in decide(w).sync if "job" in p.status]
    assert patch.status == {
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
    assert [p for p in decide(apply(w, decide(w))).sync if "job" in p.status] == []


def test_idle_runners_stay_idle_while_the_runner_list_cannot_be_read() -> None:
    vms = (
        vm("aaaaaa", runner=(1, True, False)),
        vm("bbbbbb", runner=(2, True, True)),
        vm("cccccc"),
    )
    failure = GitHubFailure(
        kind="RateLimited", message="limited", rate_kind="secondary", retry_after=60
    )
    plan = decide(world(vms, None, github=GitHubView(connected=True, failure=failure)))
    s = plan.settlement
    assert s is not None
    assert (s.status["idle"], s.status["busy"], s.status["starting"]) == (1, 1, 1)
    assert plan.sync == ()  # nothing is copied from a list that was not read


# --------------------------------------------------------------------------------------------
# Demand annotation and webhook Secret


def test_a_bad_demand_annotation_is_reported_and_ignored() -> None:
    w = world(pool=pool_obj(annotations={"imp.dev/runner-demand": "lots"}))
    plan = decide(w)
    assert "InvalidDemand" in reasons(plan)
    assert plan.settlement is not None and plan.settlement.status["pendingJobs"] == 0


def test_a_missing_webhook_secret_is_an_event() -> None:
    plan = decide(world(webhook_secret_missing="hook"))
    (ev,) = [e for e in plan.settlement.events if e.reason == "WebhookSecretMissing"]  # type: ignore[union-attr]
    assert ev.warning and "'hook'" in ev.message


# --------------------------------------------------------------------------------------------
# Template roll-out


def outdated(suffix: str, **kw: Any) -> Any:
    return vm(suffix, image=NEW_IMAGE, **kw)  # made from an image the template no longer names


def test_rollout_replaces_idle_vms_never_below_min_idle_and_busy_ones_finish_first() -> None:
    vms = (
        outdated("aaaaaa", runner=(1, True, False), created=30),
        outdated("bbbbbb", runner=(2, True, False), created=20),
        outdated("cccccc", runner=(3, True, True), created=10),
    )
    runners = (reg(1, "aaaaaa"), reg(2, "bbbbbb"), reg(3, "cccccc", busy=True))
    w = world(vms, runners, pool=pool_obj(minIdle=2, scaleUpStep=1, maxConcurrent=10))
    plan = decide(w)
    assert plan.settlement is not None and plan.settlement.status["outdated"] == 3
    # desired = busy 1 + minIdle 2 = 3; supply counts only the busy one: replacements first
    assert plan.create == 1
    assert plan.deletions == ()  # 2 idle, minIdle 2: none can go yet
    for _ in range(12):
        w = apply(w, plan)
        # replacements come online as their guests boot
        online = tuple(dataclasses.replace(r, online=True) for r in w.github.runners or ())
        w = dataclasses.replace(w, github=dataclasses.replace(w.github, runners=online))
        plan = decide(w)
        assert len(plan.deletions) <= 1  # at most scaleUpStep per pass
        ready = {r.id for r in online if not r.busy}
        assert len(ready - {d.runner_id for d in plan.deletions}) >= 2  # never below minIdle
    names = {v.name for v in w.vms}
    assert PREFIX + "cccccc" in names  # busy: finishes its job first
    assert not {PREFIX + "aaaaaa", PREFIX + "bbbbbb"} & names
    s = plan.settlement
    assert s is not None and s.status["outdated"] == 1


def test_rollout_deletions_are_outdated_reason_and_deregister_first() -> None:
    vms = (outdated("aaaaaa", runner=(1, True, False)), vm("bbbbbb", runner=(2, True, False)))
    plan = decide(world(vms, (reg(1, "aaaaaa"), reg(2, "bbbbbb")), pool=pool_obj(minIdle=1)))
    assert plan.sizing is not None
    (d,) = [d for d in plan.sizing.delete_vms if d.reason is Reason.OUTDATED]
    assert d.name == PREFIX + "aaaaaa" and d.deregister_first
    assert plan.create == 0  # the current idle VM already meets minIdle


def test_a_class_resize_makes_vms_outdated() -> None:
    bigger = dataclasses.replace(CLASS, spec=CLASS.spec.model_copy(update={"vcpu": 4}))
    w = world((vm("aaaaaa", runner=(1, True, False)),), (reg(1, "aaaaaa"),))
    assert decide(w).settlement.status["outdated"] == 0  # type: ignore[union-attr]
    assert decide(dataclasses.replace(w, vm_class=bigger)).settlement.status["outdated"] == 1  # type: ignore[union-attr]


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
                image=NEW_IMAGE if old else TEMPLATE.spec.image,
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
def test_applying_a_plan_then_deciding_again_does_nothing_more(w: Any) -> None:
    """Passes converge: within a bounded number of passes at one clock reading the plan is
    empty (no act, no status write, no Event), and stays so. No VM that got its Secret is minted
    again, and no VM is both minted and deleted by one plan."""
    minted: set[str] = set()
    for _ in range(12):
        plan = decide(w)
        assert plan.settlement is not None
        for m in plan.mints:
            assert m.vm not in minted or m.record_only, "a VM minted twice"
        minted |= {m.vm for m in plan.mints}
        assert not minted & {d.name for d in plan.deletions if d.name in {m.vm for m in plan.mints}}
        if plan.acts == 0 and not plan.settlement.write and not plan.settlement.events:
            break
        w = apply(w, plan)
    else:
        raise AssertionError(f"no fixpoint: {plan}")
    again = decide(apply(w, plan))
    assert again.acts == 0 and again.settlement is not None and not again.settlement.write


@settings(max_examples=100, deadline=None)
@given(worlds(), st.randoms(use_true_random=False))
def test_conditions_and_status_are_a_function_of_the_world(w: Any, rnd: random.Random) -> None:
    a = decide(w)
    shuffled = dataclasses.replace(
        w,
        vms=tuple(rnd.sample(list(w.vms), len(w.vms))),
        github=dataclasses.replace(
            w.github, runners=tuple(rnd.sample(list(w.github.runners), len(w.github.runners)))
        ),
    )
    b = decide(shuffled)
    assert a.settlement is not None and b.settlement is not None
    assert a.settlement.conditions == b.settlement.conditions
    assert a.settlement.status == b.settlement.status
    assert decide(w) == a  # deterministic


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
    removed = {d.name for d in decide(w).deletions}
    assert removed == (set() if since < cooldown else {v.name for v in vms})


@settings(max_examples=100, deadline=None)
@given(st.floats(-100, 100), st.floats(0, 0.999))
def test_backoff_is_honoured(until: float, jitter: float) -> None:
    """While the backoff runs, no JIT config is minted and no VM created; after it, both."""
    w = world(
        (vm("aaaaaa", secret=False, created=5),),
        (),
        backoff=BackoffState(1, MONO + until, "x"),
        jitter=jitter,
    )
    plan = decide(w)
    waiting = MONO + until > MONO
    assert plan.use_github is not waiting
    if waiting:
        assert plan.create == 0 and plan.mints == ()
    else:
        assert [m.vm for m in plan.mints] == [PREFIX + "aaaaaa"]


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
    deleted = [d for d in decide(w).deletions if d.name == PREFIX + "aaaaaa"]
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
    plan = decide(world((same, old), (reg(1, "aaaaaa"), reg(2, "bbbbbb"))))
    assert plan.settlement is not None and plan.settlement.status["outdated"] == 1


def test_manifests_make_the_pool_own_its_vms_and_each_vm_its_secret() -> None:
    from impvm.scaling.poolpass import Mint, jit_secret_manifest, vm_manifest

    w = world()
    plan = decide(w)
    assert plan.new_vm is not None
    body = vm_manifest(w.pool, plan.new_vm, PREFIX + "abcdef")
    (owner,) = body["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "ImpVMRunnerPool",
        w.pool.uid,
        True,
    )
    assert body["metadata"]["labels"] == {"imp.dev/runner-pool": "pool"}
    assert body["spec"] == plan.new_vm.spec
    mint = Mint(
        vm=PREFIX + "abcdef",
        vm_uid="u-1",
        secret=PREFIX + "abcdef-jit",
        stale_runner_id=None,
        record_only=False,
    )
    sec = jit_secret_manifest(w.pool, mint, "e30=")
    (owner,) = sec["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ImpVM", mint.vm, "u-1")
    assert sec["data"] == {"jitconfig": "ZTMwPQ=="}


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
    done = settle(w, decide(w), Outcome())
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
    done2 = settle(w2, decide(w2), Outcome())
    cond2 = conditions_of(done2)["Unschedulable"]
    assert (cond2["status"], cond2["reason"]) == ("False", "Schedulable")
    assert not [e for e in done2.events if e.reason == "Unschedulable"]


def test_no_agent_at_all_is_unschedulable() -> None:
    w = world((vm("aaaaaa", phase=None, created=60),), ())
    cond = conditions_of(settle(w, decide(w), Outcome()))["Unschedulable"]
    assert (cond["status"], cond["reason"]) == ("True", "NoAgents")
