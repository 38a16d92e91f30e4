"""The pool controller against a real kube-apiserver and the GitHub stand-in over HTTP, one
reconcile pass at a time (the failure-boundary table of docs/architecture.md).

Each test drives :class:`impvm.operator.pool.PoolReconciler` exactly as the operator's daemon
does, with the operator's clock under the test's control, then reads the results from the API
server (pool status, ImpVMs, Secrets), from the stand-in (registrations, request log) and from
the Events read back from the API server. Every test ends by searching all of it, and the log, for secret values.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.authorization_v1 import ResourceAttributes, SubjectAccessReviewSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import PolicyRule, RoleRef, Subject
from lightkube.resources.authorization_v1 import SubjectAccessReview
from lightkube.resources.rbac_authorization_v1 import (
    ClusterRole,
    ClusterRoleBinding,
    Role,
    RoleBinding,
)
from lightkube.types import PatchType
from pydantic import SecretStr

from impvm.api.models import API_VERSION, POOL_LABEL
from impvm.api.resources import ImpVMResource
from impvm.devstack.seed import APP_ID, INSTALLATION_ID, ORG, REPO
from impvm.devstack.standin.records import Failure
from impvm.devstack.standin_runner import decode_jitconfig
from impvm.github import AppCredentials, GitHubClient, Scope
from impvm.kube.admin import service_account_kubeconfig
from impvm.operator.pool import runner_prefix, secret_name
from tests.operator.conftest import (
    BASE_IMAGE,
    JIT_PATH,
    POOL,
    RUNNER_LAYER,
    RUNNER_PATH,
    PoolEnv,
    operator_context,
)

pytestmark = [pytest.mark.controlplane]

JOB_LABELS = ["self-hosted", "imp"]


def session_token(jit: str) -> str:
    return decode_jitconfig(jit)[1]


async def wait_until(what: str, check: Any, seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def one_vm_with_secret(env: PoolEnv) -> dict[str, Any]:
    """The pool's single VM; asserts its JIT Secret is attached and holds the config of the
    single registration carrying the VM's name, and that status.runner names that runner."""
    (vm,) = await env.vms()
    name = vm["metadata"]["name"]
    assert vm["spec"].get("runnerConfigSecret") == secret_name(name)
    (reg,) = env.runners_named(name)
    assert session_token(await env.jit_of(vm)) == reg.session_token
    assert vm["status"]["runner"]["id"] == reg.id
    return vm


# ---------------------------------------------------------------------- template missing


async def test_template_missing_requeues_after_30s_until_it_exists(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    await env.create_credentials()
    pool = await env.create_pool()

    assert await env.run_pass() == 30.0
    conds = await env.conditions()
    assert conds["TemplateMissing"]["status"] == "True"
    assert conds["TemplateMissing"]["reason"] == "NotFound"
    assert "gh-runner" in conds["TemplateMissing"]["message"]
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "TemplateMissing")
    assert (await env.status())["observedGeneration"] == pool["metadata"]["generation"]
    assert await env.vms() == []
    assert env.standin.state.requests == []  # nothing asked of GitHub
    (ev,) = env.events_with("TemplateMissing")
    assert ev.type == "Warning" and "gh-runner" in ev.message

    # still missing: same answer, no second Event for the same condition
    assert await env.run_pass() == 30.0
    assert len(env.events_with("TemplateMissing")) == 1

    # the template exists but its class does not
    await env.create_template()
    assert await env.run_pass() == 30.0
    conds = await env.conditions()
    assert (conds["TemplateMissing"]["status"], conds["TemplateMissing"]["reason"]) == (
        "True",
        "ClassNotFound",
    )
    assert env.class_name in conds["TemplateMissing"]["message"]
    assert await env.vms() == []

    await env.create_class()
    delay = await env.run_pass()
    assert delay is not None and delay < 30.0
    conds = await env.conditions()
    assert conds["TemplateMissing"]["status"] == "False"
    assert conds["Ready"]["status"] == "True"
    vm = await one_vm_with_secret(env)
    assert vm["spec"]["image"] == BASE_IMAGE and vm["spec"]["runnerLayer"] == RUNNER_LAYER
    await env.assert_no_secrets(caplog)


# ---------------------------------------------------------------------- status


async def test_status_counts_desired_pending_and_observed_generation(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    pool = await env.ready_pool(scaleUpStep=1, minIdle=1)
    st = env.standin.state
    st.queue_job(REPO, JOB_LABELS)
    st.queue_job(REPO, JOB_LABELS)
    st.queue_job(REPO, ["self-hosted", "gpu"])  # not for this pool

    await env.run_pass()
    s = await env.status()
    # desired = min(maxConcurrent 5, busy 0 + pending 2 + minIdle 1); one created (step 1)
    assert (s["desired"], s["pendingJobs"]) == (3, 2)
    assert (s["starting"], s["idle"], s["busy"], s["total"]) == (1, 0, 0, 1)
    assert s["observedGeneration"] == pool["metadata"]["generation"]
    assert s["lastScaleUpTime"]
    conds = await env.conditions()
    assert conds["Ready"]["status"] == "True"
    for t in ("TemplateMissing", "CredentialsInvalid", "GitHubUnavailable", "RateLimited"):
        assert conds[t]["status"] == "False", conds[t]
    (ev,) = env.events_with("ScaledUp")
    assert ev.type == "Normal" and "created 1 VM" in ev.message
    await one_vm_with_secret(env)

    # the runner comes online: idle; the next VM starts
    await env.bring_online()
    await env.run_pass()
    s = await env.status()
    assert (s["starting"], s["idle"], s["busy"], s["total"]) == (1, 1, 0, 2)
    assert len(env.events_with("ScaledUp")) == 2

    # the idle runner takes a job: busy; the poll (after its interval) sees one job left
    idle_vm = next(
        v for v in await env.vms() if env.runners_named(v["metadata"]["name"])[0].status == "online"
    )
    await env.runner_call(idle_vm, "/acquire", {"wait": 0})
    env.clock.advance(31)
    await env.run_pass()
    s = await env.status()
    assert (s["busy"], s["pendingJobs"]) == (1, 1)
    assert s["desired"] == 3  # busy 1 + pending 1 + minIdle 1

    # a spec change is observed: observedGeneration follows, on the conditions too
    await env.patch_scaling(minIdle=2)
    generation = (await env.pool())["metadata"]["generation"]
    assert generation > pool["metadata"]["generation"]
    await env.run_pass()
    s = await env.status()
    assert s["observedGeneration"] == generation
    assert s["desired"] == 4
    assert all(c["observedGeneration"] == generation for c in s["conditions"])
    await env.assert_no_secrets(caplog)


# ---------------------------------------------------------------------- GitHub failures


@pytest.mark.parametrize(
    ("status", "message", "condition", "reason"),
    [
        (502, "Server Error", "GitHubUnavailable", "TransientError"),
        (
            403,
            "Resource not accessible by integration",
            "CredentialsInvalid",
            "PermissionNotGranted",
        ),
        # GitHub refused the request itself: not an outage, only Ready says so
        (422, "Invalid request.", None, "RequestRejected"),
    ],
)
async def test_jit_mint_failure_leaves_vm_without_secret_and_retries_with_backoff(
    env: PoolEnv,
    caplog: pytest.LogCaptureFixture,
    status: int,
    message: str,
    condition: str | None,
    reason: str,
) -> None:
    await env.ready_pool()
    failure = Failure(
        kind="status", status=status, message=message, method="POST", path=JIT_PATH, count=100
    )
    env.standin.state.failures.append(failure)

    await env.run_pass()
    (vm,) = await env.vms()  # the VM is created before its Secret
    assert not vm["spec"].get("runnerConfigSecret")
    assert await env.secret_names() == set()
    assert env.standin.state.runners == {}
    conds = await env.conditions()
    if condition is None:
        for c in ("GitHubUnavailable", "CredentialsInvalid"):
            assert conds.get(c, {}).get("status") != "True", conds[c]
    else:
        assert (conds[condition]["status"], conds[condition]["reason"]) == ("True", reason)
        assert str(status) in conds[condition]["message"]
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "JitMintFailed")
    assert reason in conds["Ready"]["message"]
    assert "retry in" in conds["Ready"]["message"]
    (ev,) = env.events_with("GitHubError")
    assert ev.type == "Warning" and str(status) in ev.message
    assert len(env.requests("POST", JIT_PATH)) == 1

    # within the backoff (the first delay is 1-2 s): no new mint, no new VM, still not Ready
    env.clock.advance(0.9)
    await env.run_pass()
    assert len(env.requests("POST", JIT_PATH)) == 1
    assert [v["metadata"]["name"] for v in await env.vms()] == [vm["metadata"]["name"]]
    assert (await env.conditions())["Ready"]["status"] == "False"

    # after it: retried, fails again; the next delay doubles (2-4 s)
    env.clock.advance(1.2)
    await env.run_pass()
    assert len(env.requests("POST", JIT_PATH)) == 2
    env.clock.advance(1.9)
    await env.run_pass()
    assert len(env.requests("POST", JIT_PATH)) == 2

    # GitHub recovers: the same VM gets its Secret, the conditions clear
    env.standin.state.failures.clear()
    env.clock.advance(2.2)
    await env.run_pass()
    assert len(env.requests("POST", JIT_PATH)) == 3
    vm2 = await one_vm_with_secret(env)
    assert vm2["metadata"]["uid"] == vm["metadata"]["uid"]
    conds = await env.conditions()
    assert condition is None or conds[condition]["status"] == "False"
    assert conds["Ready"]["status"] == "True"
    await env.assert_no_secrets(caplog)


async def test_rate_limited_jit_mint_waits_for_the_reset(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    await env.ready_pool()
    env.standin.state.failures.append(
        Failure(kind="primary_rate_limit", reset_in=3600, method="POST", path=JIT_PATH)
    )
    await env.run_pass()
    conds = await env.conditions()
    assert (conds["RateLimited"]["status"], conds["RateLimited"]["reason"]) == (
        "True",
        "PrimaryRateLimit",
    )
    assert "resets" in conds["RateLimited"]["message"]
    assert conds["Ready"]["status"] == "False"
    (vm,) = await env.vms()
    assert not vm["spec"].get("runnerConfigSecret")

    env.clock.advance(600)  # far beyond the exponential backoff, before the reset
    await env.run_pass()
    assert len(env.requests("POST", JIT_PATH)) == 1

    env.clock.advance(3100)
    await env.run_pass()
    assert len(env.requests("POST", JIT_PATH)) == 2
    await one_vm_with_secret(env)
    conds = await env.conditions()
    assert conds["RateLimited"]["status"] == "False" and conds["Ready"]["status"] == "True"
    await env.assert_no_secrets(caplog)


@pytest.mark.parametrize("flag", ["removed", "suspended"])
@pytest.mark.parametrize("token_cached", [False, True], ids=["fresh", "token-cached"])
async def test_installation_unavailable_is_reported(
    env: PoolEnv, caplog: pytest.LogCaptureFixture, flag: str, token_cached: bool
) -> None:
    await env.ready_pool()
    inst = env.standin.state.installations[INSTALLATION_ID]
    if token_cached:  # a working pool whose installation goes away later
        await env.run_pass()
        await one_vm_with_secret(env)
    setattr(inst, flag, True)
    vms_before = await env.vms()

    await env.run_pass()
    conds = await env.conditions()
    c = conds["GitHubUnavailable"]
    assert (c["status"], c["reason"]) == ("True", "InstallationUnavailable")
    assert "installation is unavailable" in c["message"] and flag in c["message"]
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == (
        "False",
        "InstallationUnavailable",
    )
    assert conds.get("CredentialsInvalid", {}).get("status") != "True"
    assert any(e.type == "Warning" and flag in e.message for e in env.events_with("GitHubError"))
    # nothing created, nothing deleted while GitHub's view is unknown
    assert [v["metadata"]["uid"] for v in await env.vms()] == [
        v["metadata"]["uid"] for v in vms_before
    ]

    setattr(inst, flag, False)
    env.clock.advance(10)  # past the backoff the failure started
    await env.run_pass()
    conds = await env.conditions()
    assert conds["GitHubUnavailable"]["status"] == "False"
    assert conds["Ready"]["status"] == "True"
    await one_vm_with_secret(env)
    await env.assert_no_secrets(caplog)


@pytest.mark.parametrize(
    ("override", "reason", "needle", "event"),
    [
        # a Secret lacking a key is a local credentials problem, not a GitHub error
        (
            {"github_app_private_key": None},
            "CredentialsError",
            "github_app_private_key",
            "CredentialsInvalid",
        ),
        ({"github_app_id": "999"}, "BadCredentials", "401", "GitHubError"),
    ],
    ids=["key-missing", "wrong-app"],
)
async def test_invalid_credentials_are_reported(
    env: PoolEnv,
    caplog: pytest.LogCaptureFixture,
    override: dict[str, str | None],
    reason: str,
    needle: str,
    event: str,
) -> None:
    await env.create_class_and_template()
    await env.create_credentials(**override)
    await env.create_pool()
    await env.run_pass()
    conds = await env.conditions()
    c = conds["CredentialsInvalid"]
    assert (c["status"], c["reason"]) == ("True", reason)
    assert needle in c["message"]
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", reason)
    (ev,) = env.events_with(event)
    assert ev.type == "Warning" and needle in ev.message
    assert await env.vms() == []
    await env.assert_no_secrets(caplog, expect_tokens=False)


# ---------------------------------------------------------------------- Secret write / crashes


def _operator_rbac(kube: Client, ns: str, sa: str, create_secrets: bool) -> None:
    """What the pool controller needs, with or without ``create`` on Secrets (applied)."""
    secret_verbs = ["get", "list", "watch"] + (["create"] if create_secrets else [])
    rules = [
        PolicyRule(
            apiGroups=["imp.dev"],
            resources=["impvmrunnerpools", "impvmtemplates"],
            verbs=["get", "list", "watch"],
        ),
        PolicyRule(
            apiGroups=["imp.dev"],
            resources=["impvms"],
            verbs=["get", "list", "watch", "create", "patch", "delete"],
        ),
        PolicyRule(
            apiGroups=["imp.dev"],
            resources=["impvmrunnerpools/status", "impvms/status"],
            verbs=["get", "patch"],
        ),
        PolicyRule(apiGroups=[""], resources=["secrets"], verbs=secret_verbs),
        PolicyRule(apiGroups=[""], resources=["events"], verbs=["create"]),
    ]
    kube.apply(Role(metadata=ObjectMeta(name=sa, namespace=ns), rules=rules), force=True)
    subject = Subject(kind="ServiceAccount", name=sa, namespace=ns)
    kube.apply(
        RoleBinding(
            metadata=ObjectMeta(name=sa, namespace=ns),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name=sa),
            subjects=[subject],
        ),
        force=True,
    )
    cluster_name = f"{ns}-{sa}"
    kube.apply(
        ClusterRole(
            metadata=ObjectMeta(name=cluster_name),
            rules=[
                PolicyRule(apiGroups=["imp.dev"], resources=["impvmclasses"], verbs=["get", "list"])
            ],
        ),
        force=True,
    )
    kube.apply(
        ClusterRoleBinding(
            metadata=ObjectMeta(name=cluster_name),
            roleRef=RoleRef(
                apiGroup="rbac.authorization.k8s.io", kind="ClusterRole", name=cluster_name
            ),
            subjects=[subject],
        ),
        force=True,
    )


async def _wait_secret_create_allowed(kube: Client, ns: str, sa: str, allowed: bool) -> None:
    """Poll the API server's authorizer until the SA's ``create secrets`` is ``allowed``."""
    review = SubjectAccessReview(
        spec=SubjectAccessReviewSpec(
            user=f"system:serviceaccount:{ns}:{sa}",
            groups=["system:serviceaccounts", f"system:serviceaccounts:{ns}"],
            resourceAttributes=ResourceAttributes(namespace=ns, verb="create", resource="secrets"),
        )
    )
    for _ in range(100):
        out = kube.create(review)
        if out.status is not None and bool(out.status.allowed) == allowed:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"create secrets never became allowed={allowed}")


async def test_secret_write_failure_leaves_vm_without_setup_then_is_repaired(
    env: PoolEnv, kube: Client, caplog: pytest.LogCaptureFixture
) -> None:
    await env.ready_pool()
    sa = "impvm-operator"
    _operator_rbac(kube, env.ns, sa, create_secrets=False)
    await _wait_secret_create_allowed(kube, env.ns, sa, allowed=False)
    cfg = service_account_kubeconfig(kube, Path(env.kubeconfig), env.ns, sa)
    sa_kube = AsyncClient(config=KubeConfig.from_dict(cfg), field_manager="impvm-operator")
    ctx = operator_context(sa_kube, env.standin, env.clock)
    try:
        await env.run_pass(ctx)
        (vm,) = await env.vms()
        name = vm["metadata"]["name"]
        assert not vm["spec"].get("runnerConfigSecret")
        assert await env.secret_names() == set()
        (stale,) = env.runners_named(name)  # GitHub issued the setup; the VM cannot get it
        conds = await env.conditions()
        assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == (
            "False",
            "SecretWriteFailed",
        )
        assert "403" in conds["Ready"]["message"]
        (ev,) = env.events_with("SecretWriteFailed")
        assert ev.type == "Warning" and secret_name(name) in ev.message

        _operator_rbac(kube, env.ns, sa, create_secrets=True)
        await _wait_secret_create_allowed(kube, env.ns, sa, allowed=True)
        await env.run_pass(ctx)  # inside the backoff: no new registration
        assert env.runners_named(name) == [stale]
        env.clock.advance(10)
        await env.run_pass(ctx)
        repaired = await one_vm_with_secret(env)
        assert repaired["metadata"]["uid"] == vm["metadata"]["uid"]  # repaired, not replaced
        assert stale.id not in env.standin.state.runners  # its registration was replaced
        assert (await env.conditions())["Ready"]["status"] == "True"
        await env.assert_no_secrets(caplog)
    finally:
        await ctx.close()
        await sa_kube.close()
        kube.delete(ClusterRoleBinding, f"{env.ns}-{sa}")
        kube.delete(ClusterRole, f"{env.ns}-{sa}")


async def _create_vm_like_the_controller(env: PoolEnv) -> dict[str, Any]:
    """The state a crash right after step 2 of the pool pass leaves: the ImpVM, nothing else."""
    pool = await env.pool()
    name = runner_prefix(POOL, pool["metadata"]["uid"]) + "c0ffee"
    body = {
        "apiVersion": API_VERSION,
        "kind": "ImpVM",
        "metadata": {
            "name": name,
            "namespace": env.ns,
            "labels": {POOL_LABEL: POOL},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "ImpVMRunnerPool",
                    "name": POOL,
                    "uid": pool["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "classRef": {"name": env.class_name},
            "image": BASE_IMAGE,
            "runnerLayer": RUNNER_LAYER,
            "lifecycle": "ephemeral",
        },
    }
    out: dict[str, Any] = (await env.kube.create(ImpVMResource.from_dict(body))).to_dict()
    return out


async def test_crash_after_vm_create_before_jit_is_repaired(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    await env.ready_pool()
    vm = await _create_vm_like_the_controller(env)
    await env.run_pass()
    repaired = await one_vm_with_secret(env)
    assert repaired["metadata"]["uid"] == vm["metadata"]["uid"]
    assert len(env.requests("POST", JIT_PATH)) == 1
    assert env.requests("DELETE", RUNNER_PATH) == []
    await env.assert_no_secrets(caplog)


async def test_crash_after_jit_before_secret_write_is_repaired(
    env: PoolEnv, private_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The JIT config was minted (a registration with the VM's name exists) but never stored:
    the next pass deletes that registration first (else GitHub answers 409) and mints anew."""
    await env.ready_pool()
    vm = await _create_vm_like_the_controller(env)
    name = vm["metadata"]["name"]
    creds = AppCredentials(APP_ID, INSTALLATION_ID, SecretStr(private_key))
    async with GitHubClient(creds, api_url=env.standin.url) as gh:
        group = await gh.runner_group_id(ORG, "omni-runner")
        lost = await gh.generate_jitconfig(Scope(org=ORG), name, group, ["imp"])
    env.jit_configs.add(lost.encoded_jit_config.get_secret_value())

    await env.run_pass()
    repaired = await one_vm_with_secret(env)
    assert repaired["metadata"]["uid"] == vm["metadata"]["uid"]
    assert lost.runner_id not in env.standin.state.runners
    deletes = env.requests("DELETE", RUNNER_PATH)
    assert [d["status"] for d in deletes] == [204]

    # the repaired runner counts as idle once online (its recorded id is the live one)
    await env.bring_online()
    await env.run_pass()
    s = await env.status()
    assert (s["idle"], s["starting"], s["total"]) == (1, 0, 1)
    await one_vm_with_secret(env)
    await env.assert_no_secrets(caplog)


async def test_crash_after_secret_write_before_recording_it_is_repaired(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """The Secret was written (deterministic name) but neither it nor the runner was recorded
    on the VM: the next pass records it without asking GitHub for another JIT config."""
    await env.ready_pool()
    await env.run_pass()
    (vm,) = await env.vms()
    name = vm["metadata"]["name"]
    for resource, path in (
        (ImpVMResource, "/spec/runnerConfigSecret"),
        (ImpVMResource.Status, "/status/runner"),
    ):
        await env.kube.patch(
            resource,
            name,
            [{"op": "remove", "path": path}],
            namespace=env.ns,
            patch_type=PatchType.JSON,
        )
    vm = await env.vm(name)
    assert not vm["spec"].get("runnerConfigSecret") and not vm["status"].get("runner")
    jit_calls = len(env.requests("POST", JIT_PATH))

    await env.run_pass()
    await one_vm_with_secret(env)
    assert len(env.requests("POST", JIT_PATH)) == jit_calls
    await env.assert_no_secrets(caplog)


async def test_pass_killed_during_the_jit_request_is_repaired(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """A real crash between VM create and Secret write: the pass is cancelled while GitHub is
    answering the JIT request. Whether or not GitHub registered the runner, the next pass
    leaves exactly one registration, held by the VM's Secret."""
    await env.ready_pool()
    env.standin.state.failures.append(
        Failure(kind="timeout", delay=1.0, method="POST", path=JIT_PATH)
    )
    task = env.start_pass()
    await wait_until("the JIT request", lambda: env.requests("POST", JIT_PATH))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await env.finish_pass(task)
    (vm,) = await env.vms()
    assert not vm["spec"].get("runnerConfigSecret")
    await asyncio.sleep(1.5)  # let the stand-in finish (or drop) the abandoned request

    await env.run_pass()
    repaired = await one_vm_with_secret(env)
    assert repaired["metadata"]["uid"] == vm["metadata"]["uid"]
    assert len(env.standin.state.runners) == 1
    await env.assert_no_secrets(caplog)


# ---------------------------------------------------------------------- scale-down


async def _two_idle_then_surplus(env: PoolEnv) -> None:
    """Two online idle runners, then minIdle 1 with no cooldown: one is surplus."""
    await env.ready_pool(minIdle=2, scaleUpStep=2)
    await env.run_pass()
    assert len(await env.vms()) == 2
    await env.bring_online()
    await env.patch_scaling(minIdle=1, cooldownSeconds=0)


async def test_scale_down_deregisters_first_and_deletes_the_vm_only_after_github_accepted(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    await _two_idle_then_surplus(env)
    st = env.standin.state

    # GitHub fails the deregistration: both VMs stay
    st.failures.append(Failure(kind="status", status=502, method="DELETE", path=RUNNER_PATH))
    await env.run_pass()
    assert len(env.requests("DELETE", RUNNER_PATH)) == 1
    assert len(await env.vms()) == 2 and len(st.runners) == 2
    assert env.events_with("VMDeleted") == []

    # GitHub is slow to accept: while it answers, the VM still exists
    st.failures.append(Failure(kind="timeout", delay=0.5, method="DELETE", path=RUNNER_PATH))
    task = env.start_pass()
    await wait_until("a second DELETE", lambda: len(env.requests("DELETE", RUNNER_PATH)) == 2)
    assert len(st.runners) == 2
    assert [v for v in await env.vms() if not v["metadata"].get("deletionTimestamp")], "gone"
    assert len(await env.vms()) == 2
    await env.finish_pass(task)

    (kept,) = await env.vms()
    assert [r.name for r in st.runners.values()] == [kept["metadata"]["name"]]
    (ev,) = env.events_with("VMDeleted")
    assert ev.type == "Normal" and "surplus" in ev.message
    s = await env.status()
    assert s["desired"] == 1
    await env.assert_no_secrets(caplog)


async def test_scale_down_keeps_a_runner_that_becomes_busy_meanwhile(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """The pass observes two idle runners; between that and its deregistration both take a
    job. GitHub refuses (422) to delete a busy runner, so its VM is kept."""
    await _two_idle_then_surplus(env)
    st = env.standin.state
    st.failures.append(Failure(kind="timeout", delay=1.0, method="DELETE", path=RUNNER_PATH))
    vms = await env.vms()

    task = env.start_pass()
    await wait_until("the deregistration", lambda: env.requests("DELETE", RUNNER_PATH))
    for vm in vms:  # each runner takes a job while GitHub is still answering
        st.queue_job(REPO, JOB_LABELS)
        await env.runner_call(vm, "/acquire", {"wait": 0})
    assert all(r.busy for r in st.runners.values())
    await env.finish_pass(task)

    assert [d["status"] for d in env.requests("DELETE", RUNNER_PATH)] == [422]
    assert {v["metadata"]["uid"] for v in await env.vms()} == {v["metadata"]["uid"] for v in vms}
    assert len(st.runners) == 2
    assert env.events_with("VMDeleted") == []
    (ev,) = env.events_with("ScaleDownSkipped")
    assert "busy" in ev.message

    # the next pass sees them busy: it deletes neither and adds one for minIdle 1
    env.clock.advance(31)
    await env.run_pass()
    s = await env.status()
    assert (s["busy"], s["desired"]) == (2, 3)
    assert len(env.requests("DELETE", RUNNER_PATH)) == 1
    assert {v["metadata"]["uid"] for v in vms} < {v["metadata"]["uid"] for v in await env.vms()}
    await env.assert_no_secrets(caplog)


async def test_a_replica_that_lost_the_lead_acts_on_nothing(env: PoolEnv) -> None:
    """Fencing: while ``ctx.leading`` is False a pass creates, mints and deletes nothing; once
    leading again the same pass does its work."""
    await env.ready_pool()
    leading = {"now": False}
    env.ctx.leading = lambda: leading["now"]
    await env.run_pass()
    assert await env.vms() == []
    assert env.requests("POST", JIT_PATH) == []
    leading["now"] = True
    await env.run_pass()
    await one_vm_with_secret(env)
    assert len(env.requests("POST", JIT_PATH)) == 1
