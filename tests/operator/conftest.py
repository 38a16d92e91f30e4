"""Fixtures for the pool-controller tests: a real control plane (tests/conftest.py), the GitHub
stand-in over real HTTP, and :class:`PoolReconciler` passes run one at a time; the Events the
operator records are read back from the API server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from lightkube import AsyncClient, Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Secret
from lightkube.types import PatchType

from impvm.api.models import API_VERSION
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.devstack.seed import (
    APP_ID,
    CREDENTIALS_SECRET,
    INSTALLATION_ID,
    INSTALLATION_PERMISSIONS,
    ORG,
    REPO,
    RUNNER_GROUP,
    app_secret,
    example_scaling,
    make_private_key,
    pool_manifest,
)
from impvm.devstack.standin import StandIn
from impvm.devstack.standin_runner import decode_jitconfig
from impvm.github import RetryPolicy
from impvm.kube.controlplane import ControlPlane
from impvm.operator.context import OperatorContext, OperatorSettings
from impvm.operator.pool import PoolReconciler
from tests.support import standin_fixture

POOL = "ci-pool"
TEMPLATE = "gh-runner"
BASE_IMAGE = "registry.example/imp/runner-base@sha256:" + "1" * 64
RUNNER_LAYER = "registry.example/imp/runner-layer@sha256:" + "2" * 64
JIT_PATH = "/orgs/{org}/actions/runners/generate-jitconfig"
RUNNER_PATH = "/orgs/{org}/actions/runners/{runner_id}"


class FakeClock:
    """The operator's monotonic clock (seconds), advanced by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class PoolEnv:
    """One test's world: a namespace with class, template, credentials and pool; the stand-in;
    an operator context; the events the operator posted and every secret value seen."""

    ns: str
    kubeconfig: str
    kube: AsyncClient  # admin, for arranging and asserting
    standin: StandIn
    clock: FakeClock
    private_key: str
    class_name: str
    ctx: OperatorContext
    events: list[Event] = field(default_factory=list)
    jit_configs: set[str] = field(default_factory=set)
    session_tokens: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ arrange

    async def create_class_and_template(self) -> None:
        await self.create_class()
        await self.create_template()

    async def create_class(self) -> None:
        await self.kube.create(
            ImpVMClassResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMClass",
                    "metadata": {"name": self.class_name},
                    "spec": {"vcpu": 2, "memoryMiB": 2048, "diskGiB": 10},
                }
            )
        )

    async def create_template(self, **spec: Any) -> None:
        """The template of the minimal example, with ``spec`` fields added or overridden."""
        await self.kube.create(
            ImpVMTemplateResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMTemplate",
                    "metadata": {"name": TEMPLATE, "namespace": self.ns},
                    "spec": {
                        "classRef": {"name": self.class_name},
                        "image": BASE_IMAGE,
                        "runnerLayer": RUNNER_LAYER,
                        **spec,
                    },
                }
            )
        )

    async def create_credentials(self, **override: str | None) -> None:
        await self.kube.create(
            app_secret(
                CREDENTIALS_SECRET, self.ns, APP_ID, INSTALLATION_ID, self.private_key, **override
            )
        )

    async def create_pool(self, name: str = POOL, **scaling: Any) -> dict[str, Any]:
        """The minimal example pool (named ``name``) with ``scaling`` fields overridden."""
        body = pool_manifest(name, self.ns, {**example_scaling(), **scaling}, template=TEMPLATE)
        out: dict[str, Any] = (
            await self.kube.create(ImpVMRunnerPoolResource.from_dict(body))
        ).to_dict()
        return out

    async def ready_pool(self, **scaling: Any) -> dict[str, Any]:
        await self.create_class_and_template()
        await self.create_credentials()
        return await self.create_pool(**scaling)

    async def patch_scaling(self, **scaling: Any) -> None:
        await self.kube.patch(
            ImpVMRunnerPoolResource,
            POOL,
            {"spec": {"scaling": scaling}},
            namespace=self.ns,
            patch_type=PatchType.MERGE,
        )

    # ------------------------------------------------------------------ act

    def start_pass(self, ctx: OperatorContext | None = None) -> asyncio.Task[float | None]:
        """Start one reconcile pass of the pool as a task."""
        reconciler = PoolReconciler(ctx or self.ctx)
        return asyncio.get_running_loop().create_task(reconciler.reconcile((self.ns, POOL)))

    async def finish_pass(self, task: asyncio.Task[float | None]) -> float | None:
        try:
            return await task
        finally:
            await self.collect()

    async def run_pass(self, ctx: OperatorContext | None = None) -> float | None:
        """One reconcile pass; returns its requeue delay."""
        return await self.finish_pass(self.start_pass(ctx))

    async def pass_after(self, seconds: float, ctx: OperatorContext | None = None) -> None:
        """Move the operator's clock by ``seconds``, then run one pass."""
        self.clock.advance(seconds)
        await self.run_pass(ctx)

    async def collect(self) -> None:
        """Read the Events recorded so far; remember every secret the stand-in holds now."""
        self.events = [e async for e in self.kube.list(Event, namespace=self.ns)]
        st = self.standin.state
        for r in st.runners.values():
            self.session_tokens.add(r.session_token)
            self.jit_configs.add(st.jit_config(r))

    # ------------------------------------------------------------------ observe

    async def pool(self) -> dict[str, Any]:
        out: dict[str, Any] = (
            await self.kube.get(ImpVMRunnerPoolResource, POOL, namespace=self.ns)
        ).to_dict()
        return out

    async def status(self) -> dict[str, Any]:
        st: dict[str, Any] = (await self.pool()).get("status") or {}
        return st

    async def conditions(self) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in (await self.status()).get("conditions") or []}

    async def vms(self) -> list[dict[str, Any]]:
        return [o.to_dict() async for o in self.kube.list(ImpVMResource, namespace=self.ns)]

    async def vm(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = (
            await self.kube.get(ImpVMResource, name, namespace=self.ns)
        ).to_dict()
        return out

    async def secret_names(self) -> set[str]:
        return {
            s.metadata.name
            async for s in self.kube.list(Secret, namespace=self.ns)
            if s.metadata and s.metadata.name and s.metadata.name != CREDENTIALS_SECRET
        }

    async def jit_of(self, vm: dict[str, Any]) -> str:
        """The JIT config in the Secret the VM names (asserting the Secret is the VM's own)."""
        sname = vm["spec"]["runnerConfigSecret"]
        sec = await self.kube.get(Secret, sname, namespace=self.ns)
        assert sec.metadata is not None and sec.metadata.ownerReferences is not None
        (owner,) = sec.metadata.ownerReferences
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "ImpVM",
            vm["metadata"]["name"],
            vm["metadata"]["uid"],
            True,
        )
        assert sec.data is not None
        jit = base64.b64decode(sec.data["jitconfig"]).decode()
        self.jit_configs.add(jit)
        return jit

    def runners_named(self, name: str) -> list[Any]:
        return [r for r in self.standin.state.runners.values() if r.name == name]

    def requests(self, method: str, path: str) -> list[dict[str, Any]]:
        return [
            r for r in self.standin.state.requests if r["method"] == method and r["path"] == path
        ]

    def events_with(self, reason: str) -> list[Event]:
        return [e for e in self.events if e.reason == reason]

    # ------------------------------------------------------------------ the runner side

    async def runner_call(self, vm: dict[str, Any], path: str, body: Any = None) -> httpx.Response:
        """Call the stand-in's runner protocol with the session token from the VM's Secret
        (what the runner in the guest does)."""
        settings, token = decode_jitconfig(await self.jit_of(vm))
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
            resp = await http.post(str(settings["serverUrl"]).rstrip("/") + path, json=body)
        resp.raise_for_status()
        return resp

    async def bring_online(self) -> None:
        """Every VM's runner goes online (as its guest would after boot)."""
        for vm in await self.vms():
            await self.runner_call(vm, "/session")

    # ------------------------------------------------------------------ leaks

    async def assert_no_secrets(
        self, caplog: pytest.LogCaptureFixture, expect_tokens: bool = True
    ) -> None:
        """docs/architecture.md, "Where secrets may be": no private key line, installation
        token, JIT config or runner session token in any condition, Event, log record or
        ImpVM."""
        await self.collect()
        st = self.standin.state
        secrets = dict.fromkeys(st.tokens, "installation token")
        secrets |= dict.fromkeys(self.jit_configs, "JIT config")
        secrets |= dict.fromkeys(self.session_tokens, "runner session token")
        key_lines = [ln for ln in self.private_key.splitlines() if len(ln) > 40]
        secrets |= dict.fromkeys(key_lines, "private key line")
        assert key_lines and (st.tokens or not expect_tokens), "nothing to search for"
        haystack = [repr(await self.status())]
        haystack += [repr(v) for v in await self.vms()]
        haystack += [f"{e.type} {e.reason} {e.message}" for e in self.events]
        for rec in caplog.records:
            haystack.append(rec.getMessage())
            if rec.exc_info:
                haystack.append(logging.Formatter().formatException(rec.exc_info))
        text = "\n".join(haystack)
        leaked = sorted({kind for s, kind in secrets.items() if s in text})
        assert not leaked, f"secret values found in status/events/logs/VMs: {leaked}"


@pytest.fixture(scope="session")
def private_key() -> str:
    return make_private_key()  # PKCS#1, as the embedded stack writes it


standin = standin_fixture(
    APP_ID, INSTALLATION_ID, ORG, INSTALLATION_PERMISSIONS, [REPO], [RUNNER_GROUP]
)


def operator_context(kube: AsyncClient, standin: StandIn, clock: FakeClock) -> OperatorContext:
    """The operator's context with GitHub retries off (a failure reaches the pass at once)."""
    settings = OperatorSettings(
        github_api_url=standin.url,
        github_timeout=10.0,
        github_retry=RetryPolicy(max_transient_retries=0),
    )
    return OperatorContext(kube, settings, clock=clock)


@pytest.fixture
async def env(
    control_plane: ControlPlane,
    namespace: str,
    standin: StandIn,
    private_key: str,
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[PoolEnv]:
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="impvm")
    kubeconfig = str(control_plane.kubeconfig)
    admin = AsyncClient(config=KubeConfig.from_file(kubeconfig), field_manager="test")
    operator_kube = AsyncClient(
        config=KubeConfig.from_file(kubeconfig), field_manager="impvm-operator"
    )
    clock = FakeClock()
    e = PoolEnv(
        ns=namespace,
        kubeconfig=kubeconfig,
        kube=admin,
        standin=standin,
        clock=clock,
        private_key=private_key,
        class_name=f"cls-{uuid.uuid4().hex[:10]}",
        ctx=operator_context(operator_kube, standin, clock),
    )
    try:
        yield e
    finally:
        try:
            await admin.delete(ImpVMClassResource, e.class_name)
        except ApiError:
            pass
        await e.ctx.close()
        await operator_kube.close()
        await admin.close()


@pytest.fixture
def other_namespace(kube: Client) -> Iterator[str]:
    name = f"sched-{uuid.uuid4().hex[:6]}"
    kube.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    with contextlib.suppress(Exception):
        kube.delete(Namespace, name)


@pytest.fixture
def vm_class(kube: Client) -> Iterator[str]:
    name = f"sched-{uuid.uuid4().hex[:6]}"
    kube.create(
        ImpVMClassResource.from_dict(
            {
                "apiVersion": API_VERSION,
                "kind": "ImpVMClass",
                "metadata": {"name": name},
                "spec": {"vcpu": 1, "memoryMiB": 1024, "diskGiB": 1},
            }
        )
    )
    yield name
    with contextlib.suppress(Exception):
        kube.delete(ImpVMClassResource, name)
