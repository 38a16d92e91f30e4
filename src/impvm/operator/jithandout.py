"""The JIT config hand-out: the one way a node agent obtains a VM's JIT config.

Agents hold no right to read Secrets. An agent asks the operator
``GET /agents/v1/namespaces/<ns>/impvms/<name>/jitconfig`` with its ServiceAccount token as the
bearer token. The operator asks the API server who that is (a ``TokenReview`` with the audience
:data:`AUDIENCE`) and hands the value of the VM's JIT Secret over only when

- the token is valid for that audience — the review's ``status.audiences`` names it (the
  TokenReview API: "A client of the TokenReview API that sets the spec.audiences field should
  validate that a compatible audience identifier is returned in the status.audiences field to
  ensure that the TokenReview server is audience aware") — and names an agent ServiceAccount the
  operator was told about (``--agent-service-account``);
- the token is bound to a node: Kubernetes puts the node of a Pod-bound token, or of a token bound
  to a Node object, in the user's extra ``authentication.kubernetes.io/node-name`` (Kubernetes
  1.30+, "Bound service account tokens" in the Kubernetes authentication docs);
- the VM is bound to that node (``spec.nodeName``; the CRD forbids changing it once set) and has
  not started yet (phase empty, ``Pending`` or ``Scheduled``): after the launch nobody needs it;
- the Secret is the one the VM names and is owned by that VM (ownerReference uid).

:func:`judge` is the pure decision; :class:`JitHandout` is its shell (aiohttp handler). Every
replica answers (it only reads), so the hand-out needs no leader. Answers carry
``Cache-Control: no-store``; the value is never logged.
"""

from __future__ import annotations

import base64
import logging
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from aiohttp import web
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.core_v1 import Secret

from impvm.api.models import JIT_HANDOUT_AUDIENCE, JIT_HANDOUT_PATH, JIT_SECRET_KEY, VMPhase
from impvm.api.resources import ImpVMResource

log = logging.getLogger("impvm.operator.jithandout")

#: The audience agent tokens are requested for (a token for the API server is refused).
AUDIENCE = JIT_HANDOUT_AUDIENCE
#: The extra key Kubernetes fills with the node a ServiceAccount token is bound to.
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
#: Phases in which a VM may still be launched (and so needs its JIT config).
BEFORE_LAUNCH = frozenset({"", VMPhase.PENDING.value, VMPhase.SCHEDULED.value})
#: The path agents ask; ``{namespace}`` and ``{name}`` are the VM's.
PATH = JIT_HANDOUT_PATH
#: Object names as the API server accepts them (Kubernetes API conventions: namespaces are
#: RFC 1123 labels, ImpVM names RFC 1123 subdomains).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


class Verdict(StrEnum):
    """What :func:`judge` decided; the value is the HTTP status's reason shown to the agent."""

    GRANTED = "granted"
    UNAUTHENTICATED = "token not valid for the impvm-operator audience"
    NOT_AN_AGENT = "not an agent ServiceAccount"
    NO_NODE = "token is not bound to a node"
    OTHER_NODE = "the VM is not bound to the token's node"
    NO_VM = "no such VM"
    LAUNCHED = "the VM has already been launched"
    NOT_YET = "the JIT config is not there yet"


STATUS = {
    Verdict.GRANTED: 200,
    Verdict.UNAUTHENTICATED: 401,
    Verdict.NOT_AN_AGENT: 403,
    Verdict.NO_NODE: 403,
    Verdict.OTHER_NODE: 403,
    # A VM another node holds and one that does not exist look alike to the asker.
    Verdict.NO_VM: 403,
    Verdict.LAUNCHED: 409,
    Verdict.NOT_YET: 404,
}


@dataclass(frozen=True)
class Caller:
    """Who a TokenReview said the bearer is. ``authenticated`` False: nothing else counts;
    ``audiences``: those the review found the token valid for (its ``status.audiences``)."""

    authenticated: bool
    username: str = ""
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()
    audiences: tuple[str, ...] = ()

    @property
    def node(self) -> str | None:
        """The node the token is bound to (one value), else None."""
        for k, v in self.extra:
            if k == NODE_NAME_EXTRA and len(v) == 1 and v[0]:
                return v[0]
        return None


@dataclass(frozen=True)
class VMFacts:
    """What the hand-out needs of a VM: ``uid``, ``node`` (spec.nodeName), ``phase``
    (status.phase, "" when unset), ``secret`` (spec.runnerConfigSecret)."""

    uid: str
    node: str
    phase: str
    secret: str


@dataclass(frozen=True)
class SecretFacts:
    """What the hand-out needs of the JIT Secret: its ``name``, the uids of its controller
    owners and whether it holds a non-empty ``jitconfig``."""

    name: str
    owner_uids: frozenset[str]
    has_value: bool


def judge(
    caller: Caller,
    agents: frozenset[str],
    vm: VMFacts | None,
    secret: SecretFacts | None,
) -> Verdict:
    """Whether ``caller`` may have the JIT config of ``vm`` (None: not found) from ``secret``
    (None: not found). ``agents``: the usernames of the agent ServiceAccounts. Pure."""
    if not caller.authenticated or AUDIENCE not in caller.audiences:
        return Verdict.UNAUTHENTICATED  # an answer that does not say "for our audience": not
    if caller.username not in agents:
        return Verdict.NOT_AN_AGENT
    node = caller.node
    if node is None:
        return Verdict.NO_NODE
    if vm is None:
        return Verdict.NO_VM
    if vm.node != node:
        return Verdict.OTHER_NODE
    if vm.phase not in BEFORE_LAUNCH:
        return Verdict.LAUNCHED
    if (
        secret is None
        or not vm.secret
        or secret.name != vm.secret
        or vm.uid not in secret.owner_uids
        or not secret.has_value
    ):
        return Verdict.NOT_YET
    return Verdict.GRANTED


def caller_from_review(status: Any) -> Caller:
    """A :class:`Caller` from a ``TokenReviewStatus`` (lightkube model)."""
    if status is None or not status.authenticated or status.user is None:
        return Caller(authenticated=False)
    extra = tuple(sorted((k, tuple(v or ())) for k, v in (status.user.extra or {}).items()))
    return Caller(
        authenticated=True,
        username=status.user.username or "",
        extra=extra,
        audiences=tuple(status.audiences or ()),
    )


def vm_facts(raw: dict[str, Any]) -> VMFacts:
    """:class:`VMFacts` from an ImpVM object (dict)."""
    spec = raw.get("spec") or {}
    status = raw.get("status") or {}
    return VMFacts(
        uid=str(raw.get("metadata", {}).get("uid", "")),
        node=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or ""),
        secret=str(spec.get("runnerConfigSecret") or ""),
    )


def secret_facts(sec: Secret) -> SecretFacts:
    """:class:`SecretFacts` from a Secret (the value is looked at, not kept)."""
    meta = sec.metadata
    owners = frozenset(
        r.uid for r in (meta.ownerReferences if meta else None) or [] if r.controller
    )
    return SecretFacts(
        name=(meta.name if meta else None) or "",
        owner_uids=owners,
        has_value=bool((sec.data or {}).get(JIT_SECRET_KEY)),
    )


class JitHandout:
    """The aiohttp handler of :data:`PATH`. ``agents``: usernames of the agent
    ServiceAccounts (``system:serviceaccount:<ns>:<name>``)."""

    def __init__(self, client: AsyncClient, agents: frozenset[str]) -> None:
        self.client = client
        self.agents = agents

    async def handle(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        name = request.match_info["name"]
        if not (_DNS_LABEL.fullmatch(namespace) and _DNS_SUBDOMAIN.fullmatch(name)):
            # an encoded "/" or other non-name would address another API path: no call at all
            return web.json_response(
                {"message": "not a namespace and ImpVM name (RFC 1123)"},
                status=404,
                headers={"Cache-Control": "no-store"},
            )
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        caller = Caller(authenticated=False)
        if token:
            review = await self.client.create(
                TokenReview(spec=TokenReviewSpec(token=token, audiences=[AUDIENCE]))
            )
            caller = caller_from_review(review.status)
        vm: VMFacts | None = None
        secret: SecretFacts | None = None
        value = ""
        if (
            caller.authenticated
            and AUDIENCE in caller.audiences
            and caller.username in self.agents
            and caller.node
        ):
            vm = await self._vm(namespace, name)
            if vm is not None and vm.secret and vm.node == caller.node:
                raw = await self._secret(namespace, vm.secret)
                if raw is not None:
                    secret = secret_facts(raw)
                    value = (raw.data or {}).get(JIT_SECRET_KEY, "")
        verdict = judge(caller, self.agents, vm, secret)
        if verdict is not Verdict.GRANTED:
            log.info(
                "JIT config of %s/%s refused to %s (node %s): %s",
                namespace,
                name,
                caller.username or "an unauthenticated caller",
                caller.node,
                verdict.value,
            )
            return web.json_response(
                {"message": verdict.value},
                status=STATUS[verdict],
                headers={"Cache-Control": "no-store"},
            )
        log.info("JIT config of %s/%s handed to the agent of %s", namespace, name, caller.node)
        return web.json_response(
            {"jitconfig": base64.b64decode(value).decode()},
            headers={"Cache-Control": "no-store"},
        )

    async def _vm(self, namespace: str, name: str) -> VMFacts | None:
        try:
            got = await self.client.get(ImpVMResource, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise
        return vm_facts(got.to_dict())

    async def _secret(self, namespace: str, name: str) -> Secret | None:
        try:
            return await self.client.get(Secret, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise
