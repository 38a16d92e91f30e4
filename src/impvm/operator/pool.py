"""The pool controller: observe → decide (:func:`impvm.scaling.decide`) → act, once per pass.

Follows seed 000_e4e8de15731273f5.txt step by step: read the pool and its template, list the
pool's VMs, choose a desired count, create each ImpVM (ephemeral, labelled, owned by the pool)
*before* its JIT Secret, mint the JIT config through the GitHub App, write the Secret owned by the
VM, record its name in ``spec.runnerConfigSecret``. Failure boundaries (seed 000 table):

- template missing → condition TemplateMissing, requeue after 30 s;
- GitHub token or JIT mint fails → the VM stays without a Secret, the pass reports the error
  (condition + Event, never a secret) and the mint is retried with backoff;
- installation removed/suspended → condition GitHubUnavailable says the installation is
  unavailable;
- JIT Secret cannot be written → the VM exists without setup; the next pass repairs it (the
  registration made by the failed pass is deleted first, see ``SecretMint.stale_runner_id``).

Scale-down deletes the runner registration first and the VM only after GitHub accepted; a 422
(busy runner) keeps the VM.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import secrets as pysecrets
from dataclasses import dataclass, field
from typing import Any

from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType
from prometheus_client import Counter, Gauge

from impvm.api.models import (
    AGENT_FINALIZER,
    AGENT_LEASE_NAMESPACE,
    AGENT_LEASE_PREFIX,
    API_VERSION,
    DEMAND_ANNOTATION,
    JIT_SECRET_KEY,
    POOL_LABEL,
    TERMINAL_PHASES,
    ImpVM,
    ImpVMClass,
    ImpVMRunnerPool,
    ImpVMTemplate,
)
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.api.times import k8s_time, utcnow
from impvm.github import (
    REPO_RUNNER_GROUP_ID,
    DeleteOutcome,
    GitHubClient,
    Runner,
    Scope,
    credentials_from_secret,
)
from impvm.github.errors import (
    BadCredentials,
    CredentialsError,
    GitHubError,
    InstallationUnavailable,
    PermissionNotGranted,
    RateLimited,
    RequestRejected,
)
from impvm.operator import conditions as cond
from impvm.operator.context import OperatorContext, PoolKey
from impvm.operator.demand import poll_jobs
from impvm.operator.verify import VerifyKeyError, read_verify_key
from impvm.scaling import (
    PoolLimits,
    PoolSnapshot,
    RunnerView,
    ScalePlan,
    VMView,
    decide,
    parse_demand,
)
from impvm.scaling.jobtable import PoolScope
from impvm.scaling.labels import PoolKey as LabelPoolKey
from impvm.scaling.nodes import NodeLease, lost_nodes, node_lost

log = logging.getLogger("impvm.operator.pool")

POLL_CALLS = Counter("impvm_poll_api_calls_total", "GitHub requests made by job polling.")
POOL_VMS = Gauge("impvm_pool_vms", "VMs of a pool by state.", ["namespace", "pool", "state"])
POOL_DESIRED = Gauge("impvm_pool_desired_vms", "VMs a pool wants.", ["namespace", "pool"])
POOL_PENDING = Gauge(
    "impvm_pool_pending_jobs", "Queued jobs routed to a pool, no runner yet.", ["namespace", "pool"]
)
VMS_CREATED = Counter("impvm_vms_created_total", "ImpVMs created.", ["namespace", "pool"])
#: Key of the webhook secret in the Secret named by scaling.webhook.secretRef (DESIGN.md).
WEBHOOK_SECRET_KEY = "webhook_secret"

FIELD_MANAGER = "impvm-operator"


def runner_prefix(pool_name: str, pool_uid: str) -> str:
    """Name prefix of every VM (and so every runner) of one pool: ``<pool>-<uid[:5]>-``.

    The uid part keeps two pools with overlapping names (``ci``/``ci-x``) or equal names in two
    namespaces from ever claiming each other's runners (GARM: touch only what we created)."""
    return f"{pool_name}-{pool_uid.replace('-', '')[:5]}-"


def secret_name(vm_name: str) -> str:
    """Deterministic name of a VM's JIT Secret, so a crash between writing the Secret and
    recording it on the VM is repaired by the next pass."""
    return f"{vm_name}-jit"


@dataclass
class Observed:
    """One pass's view of a pool (the imperative shell's snapshot)."""

    pool: ImpVMRunnerPool
    raw: dict[str, Any]
    template: ImpVMTemplate | None = None
    vm_class: ImpVMClass | None = None
    #: PEM public key new VMs must be verified with (template spec.verify), None: no signatures
    verify_public_key: str | None = None
    vms: list[dict[str, Any]] = field(default_factory=list)
    secrets: set[str] = field(default_factory=set)
    runners: list[Runner] | None = None
    github: GitHubClient | None = None
    scope: Scope | None = None
    github_error: GitHubError | None = None
    #: (reason, message) of a failure this pass that makes the pool not Ready
    failure: tuple[str, str] | None = None
    #: status.lastPoll when this pass polled GitHub
    last_poll: dict[str, Any] | None = None

    @property
    def pool_name(self) -> str:
        return str(self.raw["metadata"]["name"])

    @property
    def pool_uid(self) -> str:
        return str(self.raw["metadata"]["uid"])


class PoolReconciler:
    """Reconciles one pool per :meth:`reconcile` call. Stateless but for ``ctx`` caches."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ entry point

    async def reconcile(self, key: PoolKey) -> float | None:
        """One pass over pool ``key``. Returns seconds until the next pass (None: pool gone)."""
        ns, name = key
        try:
            raw = (await self.ctx.kube.get(ImpVMRunnerPoolResource, name, namespace=ns)).to_dict()
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise
        if raw["metadata"].get("deletionTimestamp"):
            return None
        pool = ImpVMRunnerPool.model_validate(raw)
        obs = Observed(pool=pool, raw=raw)
        conditions = cond.ConditionSet.from_status(raw.get("status"), raw["metadata"]["generation"])

        # 1. template and class (seed 000: the template gives base image and class)
        if not await self._observe_template(obs, conditions):  # requeue after 30 s
            await self._write_status(key, obs, conditions, None)
            return self.ctx.settings.template_missing_requeue_seconds

        await self._register(key, obs)
        # 2. GitHub: credentials, then runners (before VMs: see impvm.scaling ordering rule)
        await self._observe_github(key, obs, conditions)
        # 3. the pool's VMs and their Secrets; VMs stranded on lost nodes
        await self._observe_vms(obs)
        await self._release_lost_nodes(obs)
        # 4. demand
        queued = await self._observe_demand(key, obs, conditions)

        snapshot = self._snapshot(obs, queued)
        plan = decide(snapshot)
        created = await self._act(key, obs, plan, conditions)
        if obs.github is not None and obs.github_error is None and obs.failure is None:
            self.ctx.pool(key).github_backoff.succeeded()
        await self._sync_vm_runner_status(obs)
        await self._sync_vm_job_status(obs)
        await self._write_status(key, obs, conditions, plan, created)
        busy = plan.create > created or plan.counts.starting > 0 or bool(plan.mint_secrets)
        s = self.ctx.settings
        return s.busy_resync_seconds if busy else s.resync_seconds

    # ------------------------------------------------------------------ observe

    async def _observe_template(self, obs: Observed, conditions: cond.ConditionSet) -> bool:
        ns = obs.raw["metadata"]["namespace"]
        tname = obs.pool.spec.template_name
        try:
            t = await self.ctx.kube.get(ImpVMTemplateResource, tname, namespace=ns)
        except ApiError as e:
            if e.status.code != 404:
                raise
            msg = f"ImpVMTemplate {tname!r} not found in namespace {ns}; retrying in 30s"
            if conditions.set("TemplateMissing", True, "NotFound", msg):
                await self._event(obs, "TemplateMissing", msg, warning=True)
            conditions.set("Ready", False, "TemplateMissing", msg)
            return False
        obs.template = ImpVMTemplate.model_validate(t.to_dict())
        cname = obs.template.spec.class_ref.name
        try:
            c = await self.ctx.kube.get(ImpVMClassResource, cname)
        except ApiError as e:
            if e.status.code != 404:
                raise
            msg = f"ImpVMClass {cname!r} (from template {tname!r}) not found; retrying in 30s"
            if conditions.set("TemplateMissing", True, "ClassNotFound", msg):
                await self._event(obs, "TemplateMissing", msg, warning=True)
            conditions.set("Ready", False, "TemplateMissing", msg)
            return False
        obs.vm_class = ImpVMClass.model_validate(c.to_dict())
        try:
            obs.verify_public_key = await read_verify_key(self.ctx.kube, ns, obs.template)
        except VerifyKeyError as e:  # no VM without its key: it would boot unverified images
            msg = f"ImpVMTemplate {tname!r}: {e}; retrying in 30s"
            if conditions.set("TemplateMissing", True, "VerifyKeyMissing", msg):
                await self._event(obs, "TemplateMissing", msg, warning=True)
            conditions.set("Ready", False, "TemplateMissing", msg)
            return False
        conditions.set("TemplateMissing", False, "Found", f"template {tname} and class {cname}")
        return True

    async def _observe_github(
        self, key: PoolKey, obs: Observed, conditions: cond.ConditionSet
    ) -> None:
        ns = key[0]
        platform = obs.pool.spec.platform
        obs.scope = Scope(org=platform.scope.org, repo=platform.scope.repo)
        try:
            sec = await self.ctx.kube.get(Secret, platform.credentials_secret, namespace=ns)
        except ApiError as e:
            if e.status.code != 404:
                raise
            err = CredentialsError(f"credentials Secret {platform.credentials_secret!r} not found")
            await self._github_failed(key, obs, conditions, err)
            return
        data = {k: base64.b64decode(v) for k, v in (sec.data or {}).items()}
        fingerprint = (
            f"{sec.metadata.resourceVersion if sec.metadata else ''}|{platform.server_url}"
        )
        try:
            creds = credentials_from_secret(data, platform.token_source)
        except CredentialsError as e:
            await self._github_failed(key, obs, conditions, e)
            return
        s = self.ctx.settings
        obs.github = self.ctx.github_client(
            ns,
            platform.credentials_secret,
            fingerprint,
            lambda: GitHubClient(
                creds,
                server_url=platform.server_url,
                api_url=s.github_api_url,
                timeout=s.github_timeout,
                retry=s.github_retry,
            ),
        )
        mem = self.ctx.pool(key)
        now = self.ctx.clock()
        if not mem.github_backoff.ready(now):
            # GitHub failed recently: no GitHub call at all this pass (the inventory is
            # unknown, so nothing GitHub-based is decided either)
            wait = mem.github_backoff.not_before - now
            obs.failure = ("GitHubBackoff", f"{mem.last_error}; retry in {wait:.0f}s")
            obs.github = None
            return
        prefix = runner_prefix(obs.pool_name, obs.pool_uid)
        try:
            obs.runners = await obs.github.list_runners(obs.scope, name_prefix=prefix)
        except GitHubError as e:
            await self._github_failed(key, obs, conditions, e)
            return
        conditions.set("CredentialsInvalid", False, "Valid", "credentials accepted by GitHub")
        conditions.set("GitHubUnavailable", False, "Available", "GitHub answered")
        conditions.set("RateLimited", False, "WithinLimits", "")

    async def _github_failed(
        self, key: PoolKey, obs: Observed, conditions: cond.ConditionSet, err: GitHubError
    ) -> None:
        """Record a GitHub/credentials failure in conditions and an Event (no secrets: the
        client's messages are redacted, ours name keys, never values)."""
        obs.github_error = err
        msg = str(err)
        reason = type(err).__name__
        at_least = err.retry_after if isinstance(err, RateLimited) else 0.0
        self.ctx.pool(key).github_backoff.failed(self.ctx.clock(), at_least)
        if isinstance(err, RequestRejected):  # GitHub refused this request; it is not down
            changed = obs.failure is None
            obs.failure = ("GitHubRejected", msg)
        elif isinstance(err, CredentialsError | BadCredentials):
            changed = conditions.set("CredentialsInvalid", True, reason, msg)
        elif isinstance(err, RateLimited):
            reset = utcnow() + dt.timedelta(seconds=err.retry_after)
            changed = conditions.set(
                "RateLimited",
                True,
                f"{err.kind.capitalize()}RateLimit",
                f"{msg}; resets {k8s_time(reset)}",
            )
        elif isinstance(err, InstallationUnavailable):
            msg = f"the GitHub App installation is unavailable ({err.reason}): {msg}"
            changed = conditions.set("GitHubUnavailable", True, "InstallationUnavailable", msg)
        elif isinstance(err, PermissionNotGranted):
            changed = conditions.set("CredentialsInvalid", True, reason, msg)
        else:
            changed = conditions.set("GitHubUnavailable", True, reason, msg)
        if changed or self.ctx.pool(key).last_error != msg:
            await self._event(obs, "GitHubError", msg, warning=True)
        self.ctx.pool(key).last_error = msg

    async def _observe_vms(self, obs: Observed) -> None:
        ns = obs.raw["metadata"]["namespace"]
        uid = obs.pool_uid
        labels: Any = {POOL_LABEL: obs.pool_name}
        obs.vms = [
            o.to_dict()
            async for o in self.ctx.kube.list(ImpVMResource, namespace=ns, labels=labels)
            if any(r.get("uid") == uid for r in o.to_dict()["metadata"].get("ownerReferences", []))
        ]
        obs.secrets = {
            s.metadata.name
            async for s in self.ctx.kube.list(Secret, namespace=ns, labels=labels)
            if s.metadata and s.metadata.name
        }

    async def _register(self, key: PoolKey, obs: Observed) -> None:
        """Tell job routing and the webhook receiver about this pool (labels, scope, webhook
        Secret). A missing webhook Secret means deliveries for this pool are refused (401)."""
        mem = self.ctx.pool(key)
        spec = obs.pool.spec
        mem.scope = PoolScope(
            key=LabelPoolKey(namespace=key[0], name=key[1], labels=tuple(spec.labels)),
            org=spec.platform.scope.org,
            repo=spec.platform.scope.repo,
        )
        scaling = spec.scaling
        ref = scaling.webhook.secret_ref if scaling and scaling.webhook else None
        mem.webhook_secret = None
        if ref is None or scaling is None or scaling.mode not in ("webhook", "hybrid"):
            return
        try:
            sec = await self.ctx.kube.get(Secret, ref.name, namespace=key[0])
        except ApiError as e:
            if e.status.code != 404:
                raise
            await self._event(obs, "WebhookSecretMissing", f"Secret {ref.name!r} not found", True)
            return
        raw = (sec.data or {}).get(WEBHOOK_SECRET_KEY)
        if raw:
            mem.webhook_secret = base64.b64decode(raw).decode()

    async def _release_lost_nodes(self, obs: Observed) -> None:
        """VMs bound to a node whose agent's Lease expired (``nodeLostGraceSeconds`` past its
        duration) can never progress: mark a live one Failed (NodeLost) so it is replaced, and
        release the agent finalizer of one being deleted so the deletion completes."""
        bound = [o for o in obs.vms if o["spec"].get("nodeName")]
        if not bound:
            return
        leases = [
            NodeLease(
                node=(lease.spec.holderIdentity if lease.spec else None) or "",
                renewed_at=lease.spec.renewTime if lease.spec else None,
                duration_seconds=(lease.spec.leaseDurationSeconds if lease.spec else None) or 40,
            )
            async for lease in self.ctx.kube.list(Lease, namespace=AGENT_LEASE_NAMESPACE)
            if lease.metadata and (lease.metadata.name or "").startswith(AGENT_LEASE_PREFIX)
        ]
        lost = lost_nodes(leases, utcnow(), self.ctx.settings.node_lost_grace_seconds)
        known = {lease.node for lease in leases}
        for o in bound:
            meta, node = o["metadata"], o["spec"]["nodeName"]
            if not node_lost(node, known, lost):
                continue
            phase = (o.get("status") or {}).get("phase")
            try:
                if meta.get("deletionTimestamp"):
                    fins = meta.get("finalizers") or []
                    if AGENT_FINALIZER in fins:
                        await self.ctx.kube.patch(
                            ImpVMResource,
                            meta["name"],
                            {
                                "metadata": {
                                    "resourceVersion": meta["resourceVersion"],
                                    "finalizers": [f for f in fins if f != AGENT_FINALIZER],
                                }
                            },
                            namespace=meta["namespace"],
                            patch_type=PatchType.MERGE,
                        )
                        await self._event(
                            obs, "NodeLost", f"{meta['name']}: node {node} lost; VM released"
                        )
                elif phase not in TERMINAL_PHASES:
                    status = {
                        "phase": "Failed",
                        "exitReason": "NodeLost",
                        "finishedAt": k8s_time(utcnow()),
                        "message": f"the agent of node {node} stopped renewing its Lease",
                    }
                    await self._patch_vm_status(meta["namespace"], meta["name"], status)
                    o.setdefault("status", {}).update(status)
                    await self._event(obs, "NodeLost", f"{meta['name']}: node {node} lost", True)
            except ApiError as e:
                if e.status.code not in (404, 409):
                    raise

    async def _observe_demand(
        self, key: PoolKey, obs: Observed, conditions: cond.ConditionSet
    ) -> int:
        """Queued jobs routed to this pool, from the job table (fed by webhooks and polls).

        Polls in polling/hybrid mode every ``intervalSeconds`` (sooner when a runner became busy:
        a queued job was taken); in webhook mode at start (an operator restart loses no job) and
        every ``webhook_resync_seconds`` (stale jobs are swept). Polling is non-essential: it
        pauses while the rate-limit budget is low."""
        mem = self.ctx.pool(key)
        scaling = obs.pool.spec.scaling
        polling = scaling.polling if scaling else None
        mode = scaling.mode if scaling else "manual"
        if mode == "manual":
            return 0
        periodic = mode in ("polling", "hybrid") and polling is not None and polling.enabled
        interval = polling.interval_seconds if polling else 0
        now = self.ctx.clock()
        busy = frozenset(r.name for r in obs.runners or () if r.busy)
        # webhook mode still polls now and then: a queued job whose later deliveries were lost
        # (cancelled, say) must not keep a VM forever; hybrid/polling poll every interval
        resync = self.ctx.settings.webhook_resync_seconds
        due = (
            not mem.last_poll
            or (periodic and (now - mem.last_poll >= interval or not busy <= mem.busy_at_poll))
            or (mode == "webhook" and now - mem.last_poll >= resync)
        )
        if due and obs.github is not None and obs.scope is not None and obs.github_error is None:
            if self._budget_low(obs, conditions):
                mem.last_poll = now  # try again next interval
            else:
                mem.busy_at_poll = busy
                await self._poll(key, obs, conditions)
                mem.last_poll = now
        assert mem.scope is not None
        return self.ctx.jobs.pending(mem.scope.key, self.ctx.scopes())

    def _budget_low(self, obs: Observed, conditions: cond.ConditionSet) -> bool:
        assert obs.github is not None
        b = obs.github.rate_budget()
        floor = self.ctx.settings.poll_budget_floor
        if b is None or not b.limit or b.remaining >= floor * b.limit:
            return False
        reset = dt.datetime.fromtimestamp(b.reset, dt.UTC)
        conditions.set(
            "RateLimited",
            True,
            "BudgetLow",
            f"{b.remaining}/{b.limit} requests left until {k8s_time(reset)}; polling paused, "
            "JIT minting continues",
        )
        return True

    async def _poll(self, key: PoolKey, obs: Observed, conditions: cond.ConditionSet) -> None:
        assert obs.github is not None and obs.scope is not None
        try:
            result = await poll_jobs(obs.github, obs.scope)
        except GitHubError as e:
            await self._github_failed(key, obs, conditions, e)
            obs.last_poll = {"time": k8s_time(utcnow()), "error": f"{type(e).__name__}: {e}"[:500]}
            return
        for job in result.jobs:
            self.ctx.jobs.apply(job)
        dropped = self.ctx.jobs.sweep(result.repositories, result.queued_ids, result.started_at)
        if dropped:
            log.info("pool %s/%s: dropped %d stale queued job(s)", *key, len(dropped))
        POLL_CALLS.inc(result.api_calls)
        obs.last_poll = {
            "time": k8s_time(utcnow()),
            "queuedJobs": len(result.queued_ids),
            "apiCalls": result.api_calls,
        }

    def _snapshot(self, obs: Observed, queued: int) -> PoolSnapshot:
        scaling = obs.pool.spec.scaling
        assert scaling is not None  # the API server requires it for github-actions pools
        status = obs.pool.status
        limits = PoolLimits(
            min_idle=scaling.min_idle or 0,
            max_concurrent=scaling.max_concurrent or 0,
            scale_up_step=scaling.scale_up_step or 1,
            cooldown_seconds=scaling.cooldown_seconds or 0,
            bootstrap_timeout_seconds=obs.pool.spec.bootstrap_timeout_seconds,
        )
        vms = tuple(self._vm_view(o, obs.secrets) for o in obs.vms)
        runners = (
            None
            if obs.runners is None
            else tuple(
                RunnerView(id=r.id, name=r.name, online=r.status == "online", busy=r.busy)
                for r in obs.runners
            )
        )
        annotations = obs.raw["metadata"].get("annotations") or {}
        return PoolSnapshot(
            limits=limits,
            now=utcnow(),
            vms=vms,
            runners=runners,
            queued_jobs=queued,
            demand_annotation=parse_demand(annotations.get(DEMAND_ANNOTATION)),
            last_scale_up_time=status.last_scale_up_time if status else None,
        )

    @staticmethod
    def _vm_view(o: dict[str, Any], secrets: set[str]) -> VMView:
        vm = ImpVM.model_validate(o)
        st = vm.status
        meta = o["metadata"]
        return VMView(
            name=meta["name"],
            created_at=dt.datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00")),
            phase=st.phase if st else None,
            started_at=st.started_at if st else None,
            deleting=bool(meta.get("deletionTimestamp")),
            runner_id=st.runner.id if st and st.runner else None,
            has_secret=bool(vm.spec.runner_config_secret)
            and vm.spec.runner_config_secret in secrets,
            job_id=st.job.id if st and st.job else None,
        )

    # ------------------------------------------------------------------ act

    async def _act(
        self, key: PoolKey, obs: Observed, plan: ScalePlan, conditions: cond.ConditionSet
    ) -> int:
        for d in plan.delete_vms:
            await self._delete_vm(obs, d.name, d.runner_id, d.deregister_first, d.message)
        if obs.github and obs.scope:
            for r in plan.delete_registrations:
                try:
                    await obs.github.delete_runner(obs.scope, r.runner_id)
                    await self._event(obs, "RegistrationRemoved", r.message)
                except GitHubError as e:
                    log.warning("pool %s/%s: could not remove registration: %s", *key, e)

        mem = self.ctx.pool(key)
        now = self.ctx.clock()
        if obs.github is None or not mem.github_backoff.ready(now):
            # GitHub failed recently: neither mint nor create until the backoff ends
            if (plan.mint_secrets or plan.create) and obs.failure is None:
                wait = mem.github_backoff.not_before - now
                obs.failure = ("GitHubBackoff", f"{mem.last_error}; retry in {wait:.0f}s")
            return 0
        for m in plan.mint_secrets:
            vm = next((o for o in obs.vms if o["metadata"]["name"] == m.name), None)
            if vm is None or not await self._mint(key, obs, vm, m.stale_runner_id, conditions):
                return 0
        created = 0
        for _ in range(plan.create):
            vm = await self._create_vm(obs)
            created += 1
            if not await self._mint(key, obs, vm, None, conditions):
                break
        if created:
            await self._event(
                obs, "ScaledUp", f"created {created} VM(s): {plan.create_reason}"[:1000]
            )
        return created

    async def _create_vm(self, obs: Observed) -> dict[str, Any]:
        """Create one ImpVM from the template (seed 000 step 2): ephemeral, labelled, owned by
        the pool; class and image copied; runnerLayer from the pool, else the template; the
        template's signing key (read by :func:`read_verify_key`) as ``spec.verify.publicKey``."""
        assert obs.template is not None
        meta = obs.raw["metadata"]
        t = obs.template.spec
        pool = obs.pool.spec
        name = runner_prefix(obs.pool_name, obs.pool_uid) + pysecrets.token_hex(3)
        spec: dict[str, Any] = {
            "classRef": {"name": t.class_ref.name},
            "image": t.image,
            "lifecycle": "ephemeral",
        }
        layer = pool.runner_layer or t.runner_layer
        if layer:
            spec["runnerLayer"] = layer
        if pool.allow_unpinned_images or t.allow_unpinned_images:
            spec["allowUnpinnedImages"] = True
        expire = pool.expire_after or t.expire_after
        if expire:
            spec["expireAfter"] = expire
        if obs.verify_public_key:
            spec["verify"] = {"publicKey": obs.verify_public_key}
        body = {
            "apiVersion": API_VERSION,
            "kind": "ImpVM",
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "labels": {POOL_LABEL: obs.pool_name},
                "ownerReferences": [
                    {
                        "apiVersion": API_VERSION,
                        "kind": "ImpVMRunnerPool",
                        "name": obs.pool_name,
                        "uid": obs.pool_uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }
        created = await self.ctx.kube.create(ImpVMResource.from_dict(body))
        out: dict[str, Any] = created.to_dict()
        obs.vms.append(out)
        return out

    async def _mint(
        self,
        key: PoolKey,
        obs: Observed,
        vm: dict[str, Any],
        stale_runner_id: int | None,
        conditions: cond.ConditionSet,
    ) -> bool:
        """Mint a JIT config for ``vm`` and attach it (seed 000 steps 3-5). Returns False when
        GitHub or the Secret write failed (the VM stays without setup; retried with backoff)."""
        mem = self.ctx.pool(key)
        vm_name = vm["metadata"]["name"]
        ns = vm["metadata"]["namespace"]
        sname = secret_name(vm_name)
        if sname in obs.secrets:
            # the Secret was written but not recorded: record it (crash repair)
            await self._record_secret(obs, vm, sname)
            return True
        if obs.github is None or obs.scope is None:
            return False
        platform = obs.pool.spec.platform
        try:
            if stale_runner_id is not None:
                outcome = await obs.github.delete_runner(obs.scope, stale_runner_id)
                if outcome is DeleteOutcome.BUSY:
                    return False
                if obs.runners is not None:  # else this pass's status sync records the old id
                    obs.runners = [r for r in obs.runners if r.id != stale_runner_id]
            if obs.scope.org is not None:
                group = await self._runner_group(key, obs, platform.runner_group)
            else:
                group = REPO_RUNNER_GROUP_ID
            jit = await obs.github.generate_jitconfig(
                obs.scope, vm_name, group, obs.pool.spec.labels
            )
        except GitHubError as e:
            await self._github_failed(key, obs, conditions, e)  # starts the backoff
            delay = mem.github_backoff.not_before - self.ctx.clock()
            msg = f"JIT config for {vm_name} not minted ({type(e).__name__}); retry in {delay:.0f}s"
            obs.failure = ("JitMintFailed", msg)
            return False
        secret = Secret(
            metadata=ObjectMeta(
                name=sname,
                namespace=ns,
                labels={POOL_LABEL: obs.pool_name},
                ownerReferences=[
                    OwnerReference(
                        apiVersion=API_VERSION,
                        kind="ImpVM",
                        name=vm_name,
                        uid=vm["metadata"]["uid"],
                        controller=True,
                        blockOwnerDeletion=True,
                    )
                ],
            ),
            type="Opaque",
            data={
                JIT_SECRET_KEY: base64.b64encode(
                    jit.encoded_jit_config.get_secret_value().encode()
                ).decode()
            },
        )
        try:
            await self.ctx.kube.create(secret)
        except ApiError as e:
            if e.status.code != 409:
                msg = f"JIT Secret {sname} could not be written (HTTP {e.status.code})"
                obs.failure = ("SecretWriteFailed", msg)
                # each retry mints (and replaces) a registration: back off like a GitHub error
                mem.last_error = msg
                mem.github_backoff.failed(self.ctx.clock())
                await self._event(obs, "SecretWriteFailed", msg, warning=True)
                return False
        obs.secrets.add(sname)
        await self._record_secret(obs, vm, sname)
        # Last: a VM with a runner id but no Secret is never minted again (impvm.scaling).
        await self._patch_vm_status(
            ns, vm_name, {"runner": {"id": jit.runner_id, "name": jit.runner_name}}
        )
        return True

    async def _runner_group(self, key: PoolKey, obs: Observed, name: str | None) -> int:
        """The org runner group id (paginated lookup), cached per pool for
        ``runner_group_ttl_seconds``: it is needed for every JIT config and rarely changes."""
        assert obs.github is not None and obs.scope is not None and obs.scope.org is not None
        mem = self.ctx.pool(key)
        now = self.ctx.clock()
        cached = mem.runner_group
        if cached and cached[0] == (obs.scope.org, name) and now < cached[2]:
            return cached[1]
        gid = await obs.github.runner_group_id(obs.scope.org, name)
        mem.runner_group = ((obs.scope.org, name), gid, now + self.ctx.settings.runner_group_ttl)
        return gid

    async def _record_secret(self, obs: Observed, vm: dict[str, Any], sname: str) -> None:
        """Record the Secret's name in ``spec.runnerConfigSecret`` (seed 000 step 5), also in
        this pass's view so the rest of the pass treats the VM as set up."""
        meta = vm["metadata"]
        await self.ctx.kube.patch(
            ImpVMResource,
            meta["name"],
            {"spec": {"runnerConfigSecret": sname}},
            namespace=meta["namespace"],
            patch_type=PatchType.MERGE,
        )
        vm["spec"]["runnerConfigSecret"] = sname

    async def _delete_vm(
        self,
        obs: Observed,
        name: str,
        runner_id: int | None,
        deregister_first: bool,
        message: str,
    ) -> bool:
        """Delete a VM; deregister its runner first when asked (a busy runner keeps its VM).
        For terminal VMs the deregistration is best effort (orphan sweep catches the rest)."""
        ns = obs.raw["metadata"]["namespace"]
        if runner_id is not None and obs.github and obs.scope:
            try:
                outcome = await obs.github.delete_runner(obs.scope, runner_id)
            except GitHubError as e:
                if deregister_first:
                    log.info("keeping %s/%s: deregistration failed: %s", ns, name, e)
                    return False
                outcome = DeleteOutcome.NOT_FOUND
            if outcome is DeleteOutcome.BUSY:
                await self._event(obs, "ScaleDownSkipped", f"runner {name} is busy; VM kept")
                return False
        elif deregister_first and runner_id is not None:
            return False  # GitHub unknown this pass: never delete a possibly busy runner
        try:
            await self.ctx.kube.delete(ImpVMResource, name, namespace=ns)
        except ApiError as e:
            if e.status.code != 404:
                raise
        await self._event(obs, "VMDeleted", f"{name}: {message}"[:1000])
        return True

    async def _sync_vm_runner_status(self, obs: Observed) -> None:
        """Copy what GitHub says of each VM's runner into ``ImpVM.status.runner``."""
        if obs.runners is None:
            return
        by_name = {r.name: r for r in obs.runners}
        for o in obs.vms:
            name = o["metadata"]["name"]
            r = by_name.get(name)
            if r is None or o["metadata"].get("deletionTimestamp"):
                continue
            if o["spec"].get("runnerConfigSecret") not in obs.secrets:
                continue  # a registration the VM cannot use: the next mint replaces it
            cur = (o.get("status") or {}).get("runner") or {}
            want = {"id": r.id, "name": r.name, "online": r.status == "online", "busy": r.busy}
            if any(cur.get(k) != v for k, v in want.items()):
                try:
                    await self._patch_vm_status(o["metadata"]["namespace"], name, {"runner": want})
                except ApiError as e:
                    if e.status.code != 404:
                        raise

    async def _sync_vm_job_status(self, obs: Observed) -> None:
        """Record on each VM the job its runner took (``in_progress`` carries ``runner_name``):
        job id, run id, repository, startedAt — what the reaper reads (ARC: jobId,
        workflowRunId, jobRepositoryName)."""
        names = {o["metadata"]["name"]: o for o in obs.vms}
        for name, job in self.ctx.jobs.running_on(names).items():
            o = names[name]
            cur = (o.get("status") or {}).get("job") or {}
            if cur.get("id") == job.id or o["metadata"].get("deletionTimestamp"):
                continue
            want: dict[str, Any] = {
                "id": job.id,
                "workflowRunId": job.run_id,
                "repository": job.repository,
            }
            if job.started_at:
                want["startedAt"] = k8s_time(job.started_at)
            try:
                await self._patch_vm_status(o["metadata"]["namespace"], name, {"job": want})
            except ApiError as e:
                if e.status.code != 404:
                    raise

    async def _patch_vm_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        await self.ctx.kube.patch(
            ImpVMResource.Status,
            name,
            {"status": status},
            namespace=ns,
            patch_type=PatchType.MERGE,
        )

    # ------------------------------------------------------------------ status

    async def _write_status(
        self,
        key: PoolKey,
        obs: Observed,
        conditions: cond.ConditionSet,
        plan: ScalePlan | None,
        created: int = 0,
    ) -> None:
        status: dict[str, Any] = {"observedGeneration": obs.raw["metadata"]["generation"]}
        if plan is not None:
            c = plan.counts
            status.update(
                starting=c.starting + created,
                idle=c.idle,
                busy=c.busy,
                total=c.total + created,
                desired=c.desired,
                pendingJobs=c.pending,
            )
            if created:
                status["lastScaleUpTime"] = k8s_time(utcnow())
                VMS_CREATED.labels(*key).inc(created)
            for state, n in (
                ("starting", c.starting + created),
                ("idle", c.idle),
                ("busy", c.busy),
                ("terminating", c.terminating),
            ):
                POOL_VMS.labels(key[0], key[1], state).set(n)
            POOL_DESIRED.labels(*key).set(c.desired)
            POOL_PENDING.labels(*key).set(c.pending)
            if obs.last_poll is not None:
                status["lastPoll"] = obs.last_poll
            if obs.failure is not None:
                conditions.set("Ready", False, *obs.failure)
            elif obs.github_error is not None:
                conditions.set(
                    "Ready", False, type(obs.github_error).__name__, str(obs.github_error)
                )
            else:
                conditions.set(
                    "Ready",
                    True,
                    "Reconciled",
                    f"{c.idle} idle, {c.busy} busy, {c.starting + created} starting; "
                    f"desired {c.desired}",
                )
        stored = obs.raw.get("status") or {}
        if (
            all(stored.get(k) == v for k, v in status.items() if k != "lastPoll")
            and (conditions.merged_into(stored.get("conditions") or []) == stored.get("conditions"))
            and "lastPoll" not in status
        ):
            return  # nothing changed: no write, no watch event for every other client
        # Other writers (the reaper) own other condition types: merge ours into what is stored
        # now, guarded by resourceVersion, and retry on a conflict.
        for _ in range(5):
            try:
                cur = (
                    await self.ctx.kube.get(ImpVMRunnerPoolResource, key[1], namespace=key[0])
                ).to_dict()
                status["conditions"] = conditions.merged_into(
                    (cur.get("status") or {}).get("conditions") or []
                )
                await self.ctx.kube.patch(
                    ImpVMRunnerPoolResource.Status,
                    key[1],
                    {
                        "metadata": {"resourceVersion": cur["metadata"]["resourceVersion"]},
                        "status": status,
                    },
                    namespace=key[0],
                    patch_type=PatchType.MERGE,
                )
                return
            except ApiError as e:
                if e.status.code == 404:
                    return
                if e.status.code != 409:
                    raise

    async def _event(self, obs: Observed, reason: str, message: str, warning: bool = False) -> None:
        """An Event on the pool (messages are ours: names, ids, redacted GitHub text); the
        recorder also logs it."""
        await self.ctx.events.record(
            api_version=API_VERSION,
            kind="ImpVMRunnerPool",
            namespace=obs.raw["metadata"]["namespace"],
            name=obs.pool_name,
            uid=obs.pool_uid,
            reason=reason,
            message=message,
            warning=warning,
        )
