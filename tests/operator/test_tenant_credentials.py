"""Credentials are scoped by their full identity, on the real API server with the GitHub
stand-in (which verifies every App JWT against the App's real public keys).

A tenant who knows another organisation's App ID and installation ID (neither is secret) and
writes them into its own credentials Secret with a key of its own mints nothing with the other
tenant's installation token: its client is its own, GitHub refuses its JWT, its pool shows
``CredentialsInvalid``, and none of the other tenant's jobs is routed to it. A rotated key gets
a new client: the tokens the old key minted are never used again."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType

from impvm.devstack.seed import make_private_key
from impvm.devstack.standin import StandIn
from impvm.github import RetryPolicy
from impvm.kube.controlplane import ControlPlane
from impvm.operator.context import OperatorContext, OperatorSettings
from tests.operator.conftest import FakeClock
from tests.tenants import CREDENTIALS, POOL, Tenant, seed_app, tenant

pytestmark = [pytest.mark.controlplane]

CLOCK = FakeClock()  # the operator's monotonic clock, moved by the tests
TOKENS = "/app/installations/{installation_id}/access_tokens"
JIT = "/orgs/{org}/actions/runners/generate-jitconfig"


@pytest.fixture
async def world(
    control_plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[tuple[AsyncClient, StandIn, OperatorContext, Tenant, Tenant]]:
    """The victim (its own App on its organisation) and the attacker (a namespace that sorts
    first); one operator context for both, as in the operator process."""
    caplog.set_level(logging.INFO, logger="impvm")
    kubeconfig = KubeConfig.from_file(str(control_plane.kubeconfig))
    admin = AsyncClient(config=kubeconfig, field_manager="test")
    operator = AsyncClient(config=kubeconfig, field_manager="impvm-operator")
    standin = StandIn()
    await standin.start()
    victim = tenant("z-victim", 31001, 41001, "victim-org")
    attacker = tenant("a-attacker", 31002, 41002, "attacker-org")
    seed_app(standin, victim)
    seed_app(standin, attacker)
    settings = OperatorSettings(
        github_api_url=standin.url, github_retry=RetryPolicy(max_transient_retries=0)
    )
    ctx = OperatorContext(operator, settings, clock=CLOCK)
    try:
        yield admin, standin, ctx, victim, attacker
    finally:
        await ctx.close()
        for t in (victim, attacker):
            await t.delete(admin)
        await standin.stop()
        await operator.close()
        await admin.close()


def calls(standin: StandIn, path: str, since: int = 0) -> list[int]:
    """Statuses of the stand-in's answers on ``path`` from request number ``since`` on."""
    return [r.get("status", 0) for r in standin.state.requests[since:] if r["path"] == path]


async def test_another_tenants_app_and_installation_with_an_own_key_mint_nothing(
    world: tuple[AsyncClient, StandIn, OperatorContext, Tenant, Tenant],
) -> None:
    kube, standin, ctx, victim, attacker = world
    await victim.create(kube, mode="polling", min_idle=1)
    await victim.run_pass(ctx)
    assert len(await victim.jit_secrets(kube)) == 1  # the victim's token is in the cache now
    assert set(calls(standin, TOKENS)) == {201}  # one token per permission set it needs

    # the attacker names the victim's App ID and installation ID, with its own key, and
    # registers in the victim's organisation
    await attacker.create(
        kube,
        app_id=victim.app_id,
        installation_id=victim.installation_id,
        scope_org=victim.org,
        mode="polling",
        min_idle=1,
    )
    mark = len(standin.state.requests)
    await attacker.run_pass(ctx)
    # its own client asked GitHub for its own token, and was refused: nothing else was asked
    assert set(calls(standin, TOKENS, mark)) == {401}
    assert calls(standin, JIT, mark) == []
    assert {r["path"] for r in standin.state.requests[mark:]} == {TOKENS}
    cond = (await attacker.conditions(kube))["CredentialsInvalid"]
    assert (cond["status"], cond["reason"]) == ("True", "BadCredentials")
    assert await attacker.jit_secrets(kube) == []

    # a job of the victim's organisation that both pools' labels fit goes to the victim only
    job = standin.state.queue_job(victim.repo, ["self-hosted", "imp"])
    CLOCK.advance(31)  # the victim's next poll is due
    await victim.run_pass(ctx)
    await attacker.run_pass(ctx)
    assert attacker.table(ctx) is None and attacker.pending(ctx) == 0
    table = victim.table(ctx)
    assert table is not None and job.id in table.jobs and victim.pending(ctx) == 1
    assert await attacker.vms(kube) == [] or all(
        not v["spec"].get("runnerConfigSecret") for v in await attacker.vms(kube)
    )
    # and the victim's own client (its key, its token) still works
    await victim.run_pass(ctx)
    cond = (await victim.conditions(kube))["CredentialsInvalid"]
    assert cond["status"] == "False"
    assert len(ctx.github.identities()) == 2  # one per key, never shared


async def test_a_rotated_key_replaces_the_client_and_its_tokens(
    world: tuple[AsyncClient, StandIn, OperatorContext, Tenant, Tenant],
) -> None:
    kube, standin, ctx, victim, _ = world
    await victim.create(kube, mode="polling", min_idle=1)
    await victim.run_pass(ctx)

    async def put_key(pem: str) -> None:
        encoded = base64.b64encode(pem.encode()).decode()
        await kube.patch(
            Secret,
            CREDENTIALS,
            {"data": {"github_app_private_key": encoded}},
            namespace=victim.ns,
            patch_type=PatchType.MERGE,
        )

    # GitHub's rotation: a second key, the Secret moves to it, the first key is deleted
    second = make_private_key()
    standin.state.add_app_key(victim.app_id, second)
    await put_key(second)
    mark = len(standin.state.requests)
    await victim.run_pass(ctx)
    assert set(calls(standin, TOKENS, mark)) == {201}  # the new key minted its own tokens
    standin.state.revoke_app_key(victim.app_id, victim.key)
    await victim.run_pass(ctx)
    assert (await victim.conditions(kube))["CredentialsInvalid"]["status"] == "False"

    # a key the App does not have: no token minted before counts, the pool says so at once
    await put_key(make_private_key())
    mark = len(standin.state.requests)
    await victim.run_pass(ctx)
    assert set(calls(standin, TOKENS, mark)) == {401}
    cond = (await victim.conditions(kube))["CredentialsInvalid"]
    assert (cond["status"], cond["reason"]) == ("True", "BadCredentials")
    assert ctx.jobs_of((victim.ns, POOL)) is None  # routed nothing while GitHub refuses it
