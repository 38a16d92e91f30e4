"""Pydantic models of the ``imp.dev/v1alpha1`` kinds: the single source of truth for the API.

The CustomResourceDefinitions in ``deploy/crds/`` are rendered from these models by
:mod:`impvm.api.crd`. Validation that must hold for every client lives in the rendered schema and
in CEL rules (``x-kubernetes-validations``) attached here with :func:`cel`, so the kube-apiserver
enforces it; the pydantic validators only parse what the API server already accepted.

Field names are the project's fixed interfaces (docs/architecture.md); runner and job fields
follow ARC's EphemeralRunner status.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "imp.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: Label on every VM of a pool (docs/architecture.md, fixed interfaces).
POOL_LABEL = "imp.dev/runner-pool"
#: Annotation on a pool holding an external demand signal (an integer).
DEMAND_ANNOTATION = "imp.dev/runner-demand"
#: Finalizer a node agent puts on a VM it claimed; released once the VM's runtime is cleaned up
#: (or by the operator when the VM's node is lost).
AGENT_FINALIZER = "imp.dev/agent"
#: Namespace of the agents' Leases (liveness and capacity) and of the operator's leader Lease:
#: the release namespace. The operator reads agent Leases here only (a Lease in any other
#: namespace is a tenant's, never a node's); an agent's ``--lease-namespace`` must name it.
AGENT_LEASE_NAMESPACE = "impvm-system"
#: Name prefix of an agent's Lease; the rest is the node name.
AGENT_LEASE_PREFIX = "impvm-agent-"
#: Label (key, value) on every agent Lease.
AGENT_LEASE_LABEL = ("app.kubernetes.io/name", "impvm-agent")
#: Annotation on a pool VM: hash of what its template made it from (image, runner layer, class
#: and its size, deadline). A VM whose hash differs from the pool's current one is outdated and
#: is replaced while idle (like ARC's ``ephemeralRunnerSetIntegrityHash``).
TEMPLATE_HASH_ANNOTATION = "imp.dev/template-hash"
#: Longest pool name: it is the value of the ``imp.dev/runner-pool`` label (Kubernetes caps
#: label values at 63 characters).
MAX_POOL_NAME = 63
#: Key of the JIT config in the Secret owned by a VM.
JIT_SECRET_KEY = "jitconfig"
#: Where a node agent asks the operator for a VM's JIT config (``{namespace}``, ``{name}``: the
#: VM's), with a node-bound ServiceAccount token for the audience :data:`JIT_HANDOUT_AUDIENCE`.
JIT_HANDOUT_PATH = "/agents/v1/namespaces/{namespace}/impvms/{name}/jitconfig"
JIT_HANDOUT_AUDIENCE = "impvm-operator"
#: Key of the webhook secret in the Secret named by ``scaling.webhook.secretRef``.
WEBHOOK_SECRET_KEY = "webhook_secret"

#: ``name@sha256:<64 hex>``: an OCI reference pinned by digest (OCI distribution spec).
DIGEST_REF_PATTERN = r"^[^@[:space:]]+@sha256:[0-9a-f]{64}$"
#: GitHub's ``owner/name`` repository form.
REPO_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}$"
#: Kubernetes object name (DNS-1123 subdomain).
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
#: Go duration string as understood by CEL's ``duration()`` (e.g. ``90s``, ``1h30m``, ``0s``).
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"


class PoolKey(NamedTuple):
    """A pool's identity: ``(namespace, name)``. A tuple, so ``("ns", "pool")`` compares equal."""

    namespace: str
    name: str


class VMPhase(StrEnum):
    """``ImpVM.status.phase``. Values are the wire strings (and the CRD enum)."""

    PENDING = "Pending"
    SCHEDULED = "Scheduled"
    STARTING = "Starting"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    TERMINATING = "Terminating"


#: Phases a VM never leaves: its runner is done (each runner is single-use).
TERMINAL_PHASES: frozenset[VMPhase] = frozenset({VMPhase.SUCCEEDED, VMPhase.FAILED})


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """Build one ``x-kubernetes-validations`` entry.

    ``message`` is what the API server returns on rejection; it always names the field.
    ``field_path`` (a JSONPath relative to the object the rule sits on, e.g. ``.scope``) makes the
    server report the error at that field.
    """
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class ApiModel(BaseModel):
    """Base of every API model: camelCase on the wire, snake_case in Python, unknown fields kept
    out (the API server prunes them anyway)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        serialize_by_alias=True,
    )

    #: CEL rules rendered into the schema of this object (see :func:`cel`).
    cel_rules: ClassVar[list[dict[str, Any]]] = []

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it: aliases, no unset/None fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _expire_after_rule(field: str) -> dict[str, Any]:
    return cel(
        "duration(self) == duration('0s') || duration(self) >= duration('60s')",
        f"{field} must be 0s (no deadline) or at least 60s",
    )


def _digest_rule(field: str, prefix: str = "self") -> dict[str, Any]:
    return cel(
        f"(has({prefix}.allowUnpinnedImages) && {prefix}.allowUnpinnedImages) || "
        f"!has({prefix}.{field}) || {prefix}.{field}.matches('{DIGEST_REF_PATTERN}')",
        f"{field} must be pinned by digest (name@sha256:<64 hex>); set allowUnpinnedImages: true "
        "to opt out",
        f".{field}",
    )


# --------------------------------------------------------------------------------------------
# Shared pieces


class LocalObjectReference(ApiModel):
    """A reference to an object by name (in the same namespace, or cluster-scoped)."""

    name: str = Field(min_length=1, max_length=253, description="Name of the referenced object.")


class Condition(ApiModel):
    """A Kubernetes condition (``metav1.Condition`` shape)."""

    type: str = Field(description="Type of the condition, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable detail; never holds a secret.")
    last_transition_time: datetime = Field(description="When the status last changed.")
    observed_generation: int | None = Field(
        default=None, ge=0, description=".metadata.generation the condition was set for."
    )


_CONDITIONS_DESC = "Latest observations of the object's state (Kubernetes API conventions)."


# --------------------------------------------------------------------------------------------
# Network egress policy (ImpVMClass, ImpVMRunnerPool, ImpVM)


class EgressPort(ApiModel):
    """A destination port or port range (the shape of Kubernetes NetworkPolicyPort)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "!has(self.endPort) || self.endPort >= self.port",
            "network.egress.allow[].ports[].endPort must be at least port",
            ".endPort",
        ),
    ]

    protocol: Literal["TCP", "UDP"] = Field(default="TCP", description="TCP (default) or UDP.")
    port: int = Field(ge=1, le=65535, description="Destination port (the first of a range).")
    end_port: int | None = Field(
        default=None, ge=1, le=65535, description="Last port of the range (inclusive)."
    )


class EgressRule(ApiModel):
    """One allowed destination: an IPv4 CIDR and, optionally, ports (none: every port of every
    protocol)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "isCIDR(self.cidr) && cidr(self.cidr).ip().family() == 4",
            "network.egress.allow[].cidr must be an IPv4 CIDR such as 203.0.113.0/24 (guests "
            "have no IPv6 egress)",
            ".cidr",
        ),
        cel(
            "!isCIDR(self.cidr) || cidr(self.cidr) == cidr(self.cidr).masked()",
            "network.egress.allow[].cidr has host bits set (write the network address, e.g. "
            "10.0.0.0/8 rather than 10.0.0.1/8)",
            ".cidr",
        ),
    ]

    cidr: str = Field(
        min_length=9, max_length=18, description="Destination network, IPv4 CIDR (a.b.c.d/n)."
    )
    ports: list[EgressPort] = Field(
        default_factory=list,
        max_length=32,
        description="Destination ports; empty: every port and protocol.",
    )


class EgressPolicy(ApiModel):
    """What a VM may reach beyond itself. Whatever this says, a guest never reaches an address
    of its node nor another VM; DNS to the node's configured resolvers is always answered."""

    policy: Literal["public", "allowlist"] = Field(
        default="public",
        description="public: every public address, and of the private, link-local "
        "(169.254.169.254 metadata included), CGNAT and loopback ranges only what allow lists; "
        "allowlist: only what allow lists.",
    )
    allow: list[EgressRule] = Field(
        default_factory=list, max_length=256, description="Destinations let through."
    )
    audit: bool = Field(
        default=False,
        description="Log what this policy would drop (kernel log, prefix 'impvm audit "
        "<layer> <namespace>/<vm>: ') and let it through, to build an allowlist before enforcing.",
    )


class NetworkSpec(ApiModel):
    """The network of a VM: its own interface, NAT to the node's uplink, an egress policy."""

    egress: EgressPolicy | None = Field(
        default=None,
        description="Egress policy. On the ImpVMClass it binds every VM of the class; on a pool "
        "(copied to its VMs) it narrows that further: a packet must pass both.",
    )


# --------------------------------------------------------------------------------------------
# ImpVMClass (cluster-scoped)

#: The label the API server puts on every namespace, holding its name (Kubernetes >= 1.21).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: A label key: an optional DNS-subdomain prefix and "/", then a name of at most 63 characters.
_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


class LabelSelectorRequirement(ApiModel):
    """One requirement of a label selector (Kubernetes LabelSelectorRequirement)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
            "namespaces.selector.matchExpressions[].values must be set for In and NotIn and "
            "empty for Exists and DoesNotExist",
            ".values",
        ),
    ]

    key: str = Field(min_length=1, max_length=317, pattern=_LABEL_KEY, description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Label values (In, NotIn); empty for Exists and DoesNotExist.",
        json_schema_extra={"items": {"type": "string", "maxLength": 63}},
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` meet this requirement (Kubernetes' semantics)."""
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels


class LabelSelector(ApiModel):
    """A label selector (Kubernetes LabelSelector): every matchLabels pair and every
    matchExpressions requirement must hold; an empty selector selects everything."""

    match_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels that must all be present with these values.",
        json_schema_extra={
            "maxProperties": 32,
            "additionalProperties": {"type": "string", "maxLength": 63},
        },
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=32, description="Requirements that must all hold."
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` are selected."""
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.match_expressions
        )


class ClassNamespaces(ApiModel):
    """Which namespaces may use a class (the shape of Gateway API's allowedRoutes.namespaces).
    Enforced by the API server (the ValidatingAdmissionPolicy impvm-class-namespaces) when a
    template or VM is created or changes its class, and by the operator's pool pass."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "(self.from == 'Selector') == has(self.selector)",
            "namespaces.selector must be set when namespaces.from is Selector, and only then",
            ".selector",
        ),
    ]

    from_: Literal["All", "Selector"] = Field(
        default="All",
        alias="from",
        description="All: every namespace (the default); Selector: only the namespaces whose "
        "labels match selector (select one by its name with the label "
        "kubernetes.io/metadata.name).",
    )
    selector: LabelSelector | None = Field(
        default=None, description="The namespaces that may use the class (from: Selector)."
    )

    def admits(self, namespace_labels: Mapping[str, str]) -> bool:
        """Whether a namespace with ``namespace_labels`` (its name included, under
        :data:`NAMESPACE_NAME_LABEL`) may use the class."""
        if self.from_ == "All":
            return True
        return self.selector is not None and self.selector.matches(namespace_labels)


class ImpVMClassSpec(ApiModel):
    """Size of a VM: vCPUs, memory (MiB) and disk (GiB)."""

    vcpu: int = Field(ge=1, le=256, description="Number of virtual CPUs.")
    memory_mib: int = Field(
        alias="memoryMiB", ge=128, le=1048576, description="Guest memory in MiB."
    )
    disk_gib: int = Field(
        alias="diskGiB", ge=1, le=65536, description="Size of the VM's writable disk in GiB."
    )
    network: NetworkSpec | None = Field(
        default=None,
        description="Network of every VM of this class (set by the cluster admin); default: "
        "egress policy public.",
    )
    namespaces: ClassNamespaces | None = Field(
        default=None,
        description="Which namespaces may use the class; default: all (set from: Selector on a "
        "class whose network opens what not every team may reach).",
    )

    def admits(self, namespace_labels: Mapping[str, str]) -> bool:
        """Whether a namespace with ``namespace_labels`` may use this class."""
        return self.namespaces is None or self.namespaces.admits(namespace_labels)


class ImpVMClass(ApiModel):
    """A VM size, shared by templates in every namespace."""

    kind: ClassVar[str] = "ImpVMClass"
    plural: ClassVar[str] = "impvmclasses"
    short_names: ClassVar[list[str]] = ["impc"]
    namespaced: ClassVar[bool] = False

    spec: ImpVMClassSpec


# --------------------------------------------------------------------------------------------
# Signed images (sigstore signatures, verified by the agent through containers-policy
# sigstoreSigned in skopeo; see docs/signing.md)

#: Default key of the public key in the Secret named by ``verify.publicKeySecretRef`` (the file
#: name ``cosign generate-key-pair`` writes the public key to).
VERIFY_PUBLIC_KEY_DEFAULT_KEY = "cosign.pub"
#: Longest accepted PEM public key (an RSA 8192 key is about 1.5 KiB).
VERIFY_PUBLIC_KEY_MAX_LENGTH = 16384
#: One PEM ``PUBLIC KEY`` block (SubjectPublicKeyInfo: ECDSA, RSA or Ed25519), as cosign writes it.
PUBLIC_KEY_PEM_PATTERN = (
    r"^\s*-----BEGIN PUBLIC KEY-----\r?\n[A-Za-z0-9+/=\r\n]+-----END PUBLIC KEY-----\s*$"
)


class PublicKeySecretRef(ApiModel):
    """A key of a Secret in the template's namespace holding a PEM public key (not secret; the
    Secret is read by the operator only, never by agents)."""

    name: str = Field(
        min_length=1, max_length=253, pattern=NAME_PATTERN, description="Secret name."
    )
    key: str = Field(
        default=VERIFY_PUBLIC_KEY_DEFAULT_KEY,
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key of the PEM public key in the Secret (default cosign.pub).",
    )


class TemplateVerifySpec(ApiModel):
    """Signatures a template's images must carry: the agent boots a VM only when its image and
    runner layer each have a sigstore signature by this key for their digest and repository."""

    public_key_secret_ref: PublicKeySecretRef = Field(
        description="Secret key holding the cosign/sigstore public key (PEM) that must have "
        "signed the image and the runner layer."
    )


class VMVerifySpec(ApiModel):
    """The signature requirement of one VM, copied by the operator from its template's
    verify.publicKeySecretRef when the VM is created (so agents never read that Secret)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            f"self.publicKey.matches(r'{PUBLIC_KEY_PEM_PATTERN}')",
            "verify.publicKey must be one PEM public key (-----BEGIN PUBLIC KEY----- ... "
            "-----END PUBLIC KEY-----)",
            ".publicKey",
        ),
    ]

    public_key: str = Field(
        min_length=1,
        max_length=VERIFY_PUBLIC_KEY_MAX_LENGTH,
        description="PEM public key that must have signed the image and the runner layer.",
    )


# --------------------------------------------------------------------------------------------
# ImpVMTemplate


class ImpVMTemplateSpec(ApiModel):
    """Base image and class of a runner VM (docs/images.md, runner image contract)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        _digest_rule("image"),
        _digest_rule("runnerLayer"),
    ]

    class_ref: LocalObjectReference = Field(description="The ImpVMClass giving the VM's size.")
    image: str = Field(
        min_length=1,
        max_length=1024,
        description="OCI base image (Debian-slim userland, CMD /usr/local/bin/runner), pinned by "
        "digest: name@sha256:<64 hex>.",
    )
    runner_layer: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="OCI image whose layer supplies /home/runner/actions-runner and "
        "/usr/local/bin/runner, pinned by digest. A pool's runnerLayer takes precedence.",
    )
    expire_after: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Hard deadline of a VM from its start (Go duration, 0s or >= 60s). 0s: none.",
        json_schema_extra={"x-kubernetes-validations": [_expire_after_rule("expireAfter")]},
    )
    allow_unpinned_images: bool | None = Field(
        default=None,
        description="Opt out of digest pinning for image and runnerLayer (not for production: "
        "a tag can change under a running pool; a digest cannot).",
    )
    verify: TemplateVerifySpec | None = Field(
        default=None,
        description="Require sigstore signatures on the image and the runner layer (unset: "
        "digest pinning only).",
    )


class ImpVMTemplate(ApiModel):
    """A VM template: image + class a pool's VMs are made from."""

    kind: ClassVar[str] = "ImpVMTemplate"
    plural: ClassVar[str] = "impvmtemplates"
    short_names: ClassVar[list[str]] = ["impt"]
    namespaced: ClassVar[bool] = True

    spec: ImpVMTemplateSpec


# --------------------------------------------------------------------------------------------
# ImpVMRunnerPool


class PlatformScope(ApiModel):
    """Where runners register: one organisation or one repository (exactly one)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "has(self.org) != has(self.repo)",
            "platform.scope: exactly one of org or repo must be set",
        ),
        cel(
            "!has(self.repo) || !(self.repo.endsWith('/.') || self.repo.endsWith('/..'))",
            "platform.scope.repo: '.' and '..' are not repository names",
            ".repo",
        ),
    ]

    org: str | None = Field(
        default=None,
        min_length=1,
        max_length=39,
        pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?$",
        description="GitHub organisation login.",
    )
    repo: str | None = Field(
        default=None,
        pattern=REPO_PATTERN,
        max_length=140,
        description="Repository as owner/name.",
    )


class Platform(ApiModel):
    """The CI platform runners connect to."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "!has(self.runnerGroup) || has(self.scope.org)",
            "platform.runnerGroup is only allowed with platform.scope.org (repository-scoped "
            "pools cannot use an organisation runner group)",
            ".runnerGroup",
        ),
    ]

    type: Literal["github-actions"] = Field(description="CI platform; github-actions.")
    scope: PlatformScope = Field(description="Organisation or repository the runners join.")
    runner_group: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description="Organisation runner group name (org scope only); default group if unset.",
    )
    credentials_secret: str = Field(
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description="Secret with github_app_id, github_app_installation_id, "
        "github_app_private_key (github_app) or github_token (pat).",
    )
    token_source: Literal["github_app", "pat"] = Field(
        default="github_app",
        description="github_app (recommended) or pat (a long-lived personal access token).",
    )
    server_url: str | None = Field(
        default=None,
        alias="serverURL",
        pattern=r"^https://[^\s/]+(/[^\s]*)?$",
        max_length=512,
        description="GitHub Enterprise Server URL (https://HOST, TLS only: tokens travel on it); "
        "the API is HOST/api/v3. "
        "Default: github.com.",
    )


class PollingSpec(ApiModel):
    """Polling of GitHub for queued jobs."""

    enabled: bool = Field(default=True, description="Whether the operator polls GitHub.")
    interval_seconds: int = Field(
        default=30, ge=5, le=3600, description="Seconds between polls of queued jobs."
    )


class SecretKeyRef(ApiModel):
    """A Secret in the pool's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")


class WebhookSpec(ApiModel):
    """workflow_job webhook deliveries."""

    secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret whose key webhook_secret verifies X-Hub-Signature-256."
    )


def _cron_field(value: str) -> str:
    """One crontab(5) field: ``*`` or a value/range, with an optional step, comma-separated."""
    item = rf"(\*|({value})(-({value}))?)(/[1-9][0-9]?)?"
    return rf"{item}(,{item})*"


def _any_case(names: str) -> str:
    """``jan|feb`` as ``[Jj][Aa][Nn]|[Ff][Ee][Bb]``: ASCII only (a case-insensitive flag would
    also fold non-ASCII letters such as U+017F into ``s``)."""
    return "|".join("".join(f"[{c.upper()}{c}]" for c in n) for n in names.split("|"))


_MONTH_NAMES = _any_case("jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec")
_DAY_NAMES = _any_case("sun|mon|tue|wed|thu|fri|sat")
#: Five-field cron expression (minute hour day-of-month month day-of-week) as crontab(5) and a
#: Kubernetes CronJob's ``schedule`` write them: numbers, three-letter names (any case), ``*``,
#: ranges, lists and steps, separated by spaces or tabs. The values' ranges are checked here so
#: the API server rejects ``61 * * * *``; croniter evaluates what is accepted.
CRON_PATTERN = (
    r"^"
    + r"[ \t]+".join(
        _cron_field(v)
        for v in (
            r"[0-5]?[0-9]",
            r"[01]?[0-9]|2[0-3]",
            r"0?[1-9]|[12][0-9]|3[01]",
            rf"0?[1-9]|1[0-2]|{_MONTH_NAMES}",
            rf"[0-7]|{_DAY_NAMES}",
        )
    )
    + r"$"
)
#: IANA time zone name (``UTC``, ``Europe/Berlin``, ``America/Argentina/Buenos_Aires``); whether
#: the zone exists is checked against the time zone database when the pool is evaluated.
TIME_ZONE_PATTERN = r"^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+){0,2}$"


class WarmPoolSchedule(ApiModel):
    """A recurring window with its own minIdle, like a KEDA cron scaler's start/end pair: the
    window opens whenever start matches and closes whenever end matches, both read as wall-clock
    times in timeZone (so 0 8 * * 1-5 is 08:00 local time in winter and in summer)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "self.start != self.end",
            "scaling.warmPool.schedules[].end must differ from start (the window would be empty)",
            ".end",
        ),
    ]

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Name of the window (shown in status.warmPool.activeSchedule).",
    )
    start: str = Field(
        max_length=200,
        pattern=CRON_PATTERN,
        description="Cron expression (5 fields) of the window's opening times, e.g. 0 8 * * 1-5.",
    )
    end: str = Field(
        max_length=200,
        pattern=CRON_PATTERN,
        description="Cron expression (5 fields) of the window's closing times, e.g. 0 18 * * 1-5.",
    )
    time_zone: str = Field(
        default="UTC",
        max_length=64,
        pattern=TIME_ZONE_PATTERN,
        description="IANA time zone start and end are read in (default UTC).",
    )
    min_idle: int = Field(
        ge=0, le=10000, description="minIdle while the window is open (replaces scaling.minIdle)."
    )


#: Defaults of the adaptive warm pool (see :mod:`impvm.scaling.warmpool`).
DEFAULT_SAFETY_PERCENT = 250
DEFAULT_ARRIVAL_HALF_LIFE_SECONDS = 300
DEFAULT_READY_HALF_LIFE_SAMPLES = 10

_ADAPTIVE_ONLY = ("maxIdle", "safetyPercent", "arrivalHalfLifeSeconds", "readyHalfLifeSamples")


class WarmPoolSpec(ApiModel):
    """How many idle runners to keep ready. fixed: scaling.minIdle. adaptive: enough to cover
    the jobs expected while a new runner boots, after Little's law (L = λW): ceil(arrival-rate
    EWMA * time-to-ready EWMA * safetyPercent/100), clamped to [minIdle, maxIdle]. In both modes
    an open schedules window replaces minIdle."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "self.mode != 'adaptive' || has(self.maxIdle)",
            "scaling.warmPool.maxIdle is required when scaling.warmPool.mode is adaptive",
            ".maxIdle",
        ),
        *[
            cel(
                f"self.mode == 'adaptive' || !has(self.{f})",
                f"scaling.warmPool.{f} is only used when scaling.warmPool.mode is adaptive",
                f".{f}",
            )
            for f in _ADAPTIVE_ONLY
        ],
    ]

    mode: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="fixed: keep scaling.minIdle idle runners (the default); adaptive: size the "
        "warm pool from the observed job arrival rate and runner time-to-ready.",
    )
    max_idle: int | None = Field(
        default=None,
        ge=0,
        le=10000,
        description="adaptive: most idle runners the warm pool asks for (required).",
    )
    safety_percent: int | None = Field(
        default=None,
        ge=100,
        le=1000,
        description=f"adaptive: safety factor in percent on the Little's-law estimate "
        f"(default {DEFAULT_SAFETY_PERCENT}).",
    )
    arrival_half_life_seconds: int | None = Field(
        default=None,
        ge=10,
        le=86400,
        description=f"adaptive: half-life in seconds of the job arrival-rate EWMA "
        f"(default {DEFAULT_ARRIVAL_HALF_LIFE_SECONDS}).",
    )
    ready_half_life_samples: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description=f"adaptive: half-life in samples of the time-to-ready EWMA "
        f"(default {DEFAULT_READY_HALF_LIFE_SAMPLES}).",
    )
    schedules: list[WarmPoolSchedule] | None = Field(
        default=None,
        max_length=20,
        description="Windows with their own minIdle; when several are open the largest wins.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class ScalingSpec(ApiModel):
    """Lower and upper capacity limits and how demand is observed."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "!has(self.minIdle) || !has(self.maxConcurrent) || self.minIdle <= self.maxConcurrent",
            "scaling.minIdle must be less than or equal to scaling.maxConcurrent",
            ".minIdle",
        ),
        cel(
            "!(self.mode in ['polling', 'hybrid']) || has(self.polling)",
            "scaling.polling is required when scaling.mode is polling or hybrid",
            ".polling",
        ),
        cel(
            "self.mode != 'polling' || !has(self.polling) || self.polling.enabled",
            "scaling.polling.enabled must be true when scaling.mode is polling (the pool would "
            "never see a job)",
            ".polling",
        ),
        cel(
            "!(self.mode in ['webhook', 'hybrid']) || "
            "(has(self.webhook) && has(self.webhook.secretRef))",
            "scaling.webhook.secretRef is required when scaling.mode is webhook or hybrid",
            ".webhook",
        ),
        cel(
            "!has(self.warmPool) || !has(self.warmPool.maxIdle) || !has(self.minIdle) || "
            "self.warmPool.maxIdle >= self.minIdle",
            "scaling.warmPool.maxIdle must be greater than or equal to scaling.minIdle",
            ".warmPool.maxIdle",
        ),
        cel(
            "!has(self.warmPool) || !has(self.warmPool.maxIdle) || !has(self.maxConcurrent) || "
            "self.warmPool.maxIdle <= self.maxConcurrent",
            "scaling.warmPool.maxIdle must be less than or equal to scaling.maxConcurrent",
            ".warmPool.maxIdle",
        ),
        cel(
            "!has(self.warmPool) || !has(self.warmPool.schedules) || !has(self.maxConcurrent) || "
            "self.warmPool.schedules.all(s, s.minIdle <= self.maxConcurrent)",
            "scaling.warmPool.schedules[].minIdle must be less than or equal to "
            "scaling.maxConcurrent",
            ".warmPool.schedules",
        ),
    ]

    mode: Literal["polling", "webhook", "hybrid", "manual"] = Field(
        default="manual",
        description="How pending jobs are observed: polling, webhook, hybrid (both), or manual "
        "(minIdle plus the imp.dev/runner-demand annotation only).",
    )
    min_idle: int | None = Field(
        default=None, ge=0, le=10000, description="Idle registered runners to keep ready."
    )
    max_concurrent: int | None = Field(
        default=None, ge=0, le=10000, description="Upper bound on the pool's VMs at once."
    )
    scale_up_step: int | None = Field(
        default=None, ge=1, le=10000, description="Most VMs created in one reconcile pass."
    )
    cooldown_seconds: int | None = Field(
        default=None,
        ge=0,
        le=86400,
        description="Seconds after a scale-up before surplus idle runners are removed.",
    )
    polling: PollingSpec | None = Field(default=None, description="Polling settings.")
    webhook: WebhookSpec | None = Field(default=None, description="Webhook settings.")
    warm_pool: WarmPoolSpec | None = Field(
        default=None,
        description="How many idle runners to keep ready (default: fixed, scaling.minIdle).",
    )


class ReaperSpec(ApiModel):
    """Removal of runners that outlive their job (after ARC's proposed runner reaper)."""

    enabled: bool = Field(default=False, description="Run the reaper for this pool.")
    max_job_seconds: int = Field(
        default=21600,
        ge=60,
        le=30 * 86400,
        description="A job running longer than this (seconds) has its runner removed.",
    )
    completed_grace_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="Seconds a run/job must have been completed before its runner is removed.",
    )
    interval_seconds: int = Field(
        default=300, ge=10, le=86400, description="Seconds between reaper passes for this pool."
    )
    dry_run: bool = Field(default=False, description="Log 'would delete' and delete nothing.")


class ImpVMRunnerPoolSpec(ApiModel):
    """What runner to keep and how many."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "self.platform.type != 'github-actions' || has(self.scaling)",
            "scaling is required for github-actions pools",
            ".scaling",
        ),
        *[
            cel(
                f"self.platform.type != 'github-actions' || !has(self.scaling) || "
                f"has(self.scaling.{f})",
                f"scaling.{f} is required for github-actions pools",
                ".scaling",
            )
            for f in ("minIdle", "maxConcurrent", "scaleUpStep", "cooldownSeconds")
        ],
        _digest_rule("runnerLayer"),
    ]

    template_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description="ImpVMTemplate giving base image and class.",
    )
    labels: list[str] = Field(
        default_factory=list,
        max_length=100,
        description="Runner labels passed to GitHub in the JIT request (besides self-hosted); a "
        "job runs here only if all its labels are in this set.",
        json_schema_extra={
            # GitHub runner labels: no commas (runs-on lists), no whitespace or control
            # characters; each label once
            "items": {
                "type": "string",
                "minLength": 1,
                "maxLength": 256,
                "pattern": r"^[^,\s\x00-\x1f]+$",
            },
            "x-kubernetes-list-type": "set",
        },
    )
    platform: Platform
    runner_layer: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="OCI runner layer pinned by digest; overrides the template's.",
    )
    allow_unpinned_images: bool | None = Field(
        default=None, description="Opt out of digest pinning for runnerLayer."
    )
    scaling: ScalingSpec | None = Field(default=None, description="Capacity limits and demand.")
    bootstrap_timeout_seconds: int = Field(
        default=300,
        ge=30,
        le=86400,
        description="Seconds a VM's runner may take to come online before the VM is replaced.",
    )
    expire_after: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Hard deadline of each VM (Go duration, 0s or >= 60s); overrides the "
        "template's.",
        json_schema_extra={"x-kubernetes-validations": [_expire_after_rule("expireAfter")]},
    )
    reaper: ReaperSpec | None = Field(default=None, description="Reaper for stuck runners.")
    network: NetworkSpec | None = Field(
        default=None,
        description="Network of the pool's VMs (copied to each VM); its egress policy applies "
        "on top of the class's.",
    )


class PollStatus(ApiModel):
    """Result of the last poll of GitHub for jobs."""

    time: datetime | None = Field(default=None, description="When the poll finished.")
    queued_jobs: int | None = Field(default=None, ge=0, description="Queued matching jobs seen.")
    api_calls: int | None = Field(default=None, ge=0, description="Requests made (304s too).")
    not_modified: int | None = Field(default=None, ge=0, description="Requests answered 304.")
    error: str | None = Field(default=None, description="Why the poll failed, if it did.")


class RateLimitStatus(ApiModel):
    """The core REST rate limit of the pool's installation as GitHub last reported it
    (``x-ratelimit-*`` headers; GitHub docs, "Rate limits for the REST API")."""

    limit: int | None = Field(default=None, ge=0, description="Requests per hour.")
    remaining: int | None = Field(default=None, ge=0, description="Requests left.")
    reset_at: datetime | None = Field(default=None, description="When the window resets.")
    installation: str | None = Field(
        default=None,
        max_length=500,
        description="Whose limit it is: the API host and the App's installation (or the "
        "credentials Secret of a token); pools with the same value share one limit.",
    )


class TimingSummary(ApiModel):
    """p50/p95 of one duration over the pool's VMs of the last hour."""

    count: int | None = Field(default=None, ge=0, description="Samples in the window.")
    p50_seconds: float | None = Field(default=None, ge=0)
    p95_seconds: float | None = Field(default=None, ge=0)


class PoolTimings(ApiModel):
    """Durations over the last hour (see docs/architecture.md, per-job timings)."""

    job_pickup: TimingSummary | None = Field(
        default=None, description="A job's wait from queued to in progress."
    )
    vm_boot: TimingSummary | None = Field(
        default=None, description="From the agent starting the VM to its runner running."
    )
    runner_registration: TimingSummary | None = Field(
        default=None, description="From the ImpVM's creation to its runner online on GitHub."
    )


class WarmPoolStatus(ApiModel):
    """The warm pool's estimates, carried from pass to pass (Kubernetes is the database: a
    restarted operator resumes from here). Changed only by observed events."""

    arrival_rate_per_minute: float | None = Field(
        default=None, ge=0, description="Job arrival-rate EWMA (jobs per minute) at updatedAt."
    )
    ready_seconds: float | None = Field(
        default=None, ge=0, description="Time-to-ready EWMA: VM created to runner online (s)."
    )
    ready_samples: int | None = Field(
        default=None, ge=0, description="Time-to-ready samples folded into readySeconds."
    )
    updated_at: datetime | None = Field(
        default=None,
        description="Events observed up to this time (RFC 3339, microseconds) are folded in.",
    )
    target: int | None = Field(
        default=None, ge=0, description="Idle runners the warm pool asked for at updatedAt."
    )
    active_schedule: str | None = Field(
        default=None, description="Name of the open schedules window that set minIdle, if any."
    )


class ImpVMRunnerPoolStatus(ApiModel):
    """Observed state of a pool."""

    observed_generation: int | None = Field(default=None, ge=0)
    starting: int | None = Field(
        default=None, ge=0, description="VMs whose runner is not yet online."
    )
    idle: int | None = Field(default=None, ge=0, description="Online runners without a job.")
    busy: int | None = Field(default=None, ge=0, description="Runners running a job.")
    total: int | None = Field(default=None, ge=0, description="VMs of the pool.")
    desired: int | None = Field(default=None, ge=0, description="VMs the controller wants.")
    pending_jobs: int | None = Field(
        default=None, ge=0, description="Queued matching jobs not yet assigned a runner."
    )
    outdated: int | None = Field(
        default=None,
        ge=0,
        description="VMs made from an older template (image, runner layer or class); idle ones "
        "are replaced, busy ones finish their job first.",
    )
    last_scale_up_time: datetime | None = Field(default=None)
    last_poll: PollStatus | None = Field(default=None)
    timings: PoolTimings | None = Field(default=None, description="p50/p95 over the last hour.")
    rate_limit: RateLimitStatus | None = Field(
        default=None, description="The installation's rate limit, as of the last status write."
    )
    warm_pool: WarmPoolStatus | None = Field(default=None, description="Warm pool estimates.")
    conditions: list[Condition] | None = Field(
        default=None,
        description=_CONDITIONS_DESC,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class ImpVMRunnerPool(ApiModel):
    """A pool of ephemeral GitHub Actions runners, one VM each."""

    kind: ClassVar[str] = "ImpVMRunnerPool"
    plural: ClassVar[str] = "impvmrunnerpools"
    short_names: ClassVar[list[str]] = ["imprp"]
    namespaced: ClassVar[bool] = True
    #: Rules on the whole object (only metadata.name and generateName are visible to them).
    object_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            f"size(self.metadata.name) <= {MAX_POOL_NAME}",
            f"metadata.name: a pool name is at most {MAX_POOL_NAME} characters (it is the value "
            "of the imp.dev/runner-pool label on its VMs)",
        )
    ]
    printer_columns: ClassVar[list[dict[str, Any]]] = [
        {"name": "Platform", "type": "string", "jsonPath": ".spec.platform.type"},
        {"name": "Template", "type": "string", "jsonPath": ".spec.templateName"},
        {"name": "Idle", "type": "integer", "jsonPath": ".status.idle"},
        {"name": "Busy", "type": "integer", "jsonPath": ".status.busy"},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desired"},
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: ImpVMRunnerPoolSpec
    status: ImpVMRunnerPoolStatus | None = None


# --------------------------------------------------------------------------------------------
# ImpVM


class RunnerStatus(ApiModel):
    """The GitHub runner registered from this VM (ARC: runnerId, runnerName)."""

    id: int | None = Field(default=None, ge=0, description="GitHub runner id.")
    name: str | None = Field(default=None, description="Runner name (the VM's name).")
    online: bool | None = Field(default=None, description="GitHub reports the runner online.")
    busy: bool | None = Field(default=None, description="GitHub reports the runner busy.")


class JobStatus(ApiModel):
    """The workflow job this VM's runner took (ARC: jobId, workflowRunId, jobRepositoryName)."""

    id: int | None = Field(default=None, ge=0, description="Workflow job id.")
    workflow_run_id: int | None = Field(default=None, ge=0, description="Workflow run id.")
    repository: str | None = Field(default=None, description="Repository as owner/name.")
    started_at: datetime | None = Field(default=None, description="When the job started.")
    completed_at: datetime | None = Field(default=None, description="When the job completed.")


class ImpVMSpec(ApiModel):
    """One VM. Created by a pool from its template."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        _digest_rule("image"),
        _digest_rule("runnerLayer"),
        cel(
            "!has(oldSelf.nodeName) || oldSelf.nodeName == '' || self.nodeName == oldSelf.nodeName",
            "nodeName cannot be changed once the VM is bound to a node",
            ".nodeName",
        ),
        cel(
            "has(self.verify) == has(oldSelf.verify) && "
            "(!has(self.verify) || self.verify == oldSelf.verify)",
            "verify cannot be added, changed or removed after the VM is created",
            ".verify",
        ),
        cel(
            "has(self.network) == has(oldSelf.network) && "
            "(!has(self.network) || self.network == oldSelf.network)",
            "network cannot be changed once the VM exists",
            ".network",
        ),
    ]

    class_ref: LocalObjectReference = Field(description="The ImpVMClass giving the VM's size.")
    image: str = Field(min_length=1, max_length=1024, description="OCI base image by digest.")
    runner_layer: str | None = Field(
        default=None, min_length=1, max_length=1024, description="OCI runner layer by digest."
    )
    allow_unpinned_images: bool | None = Field(default=None, description="Opt out of pinning.")
    lifecycle: Literal["ephemeral", "persistent"] = Field(
        default="ephemeral",
        description="ephemeral: the VM runs one job and is removed (pool VMs always are).",
    )
    runner_config_secret: str | None = Field(
        default=None,
        max_length=253,
        description="Secret (owned by this VM) whose key jitconfig holds the runner's JIT config.",
    )
    expire_after: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Hard deadline from the VM's start (Go duration, 0s or >= 60s).",
        json_schema_extra={"x-kubernetes-validations": [_expire_after_rule("expireAfter")]},
    )
    node_name: str | None = Field(
        default=None, max_length=253, description="Node (agent) the VM is bound to."
    )
    verify: VMVerifySpec | None = Field(
        default=None,
        description="Signature requirement copied from the template (immutable); unset: none.",
    )
    network: NetworkSpec | None = Field(
        default=None,
        description="Network of this VM (from its pool); its egress policy applies on top of "
        "the class's. Fixed once the VM exists.",
    )


class VMTimings(ApiModel):
    """When each step of a VM's one job happened (the agent writes scheduledAt, bootedAt and
    finishedAt; the operator createdAt, runnerOnlineAt, jobQueuedAt and jobStartedAt). Its
    deletion is the histogram ``impvm_vm_lifetime_seconds`` (the object is gone)."""

    created_at: datetime | None = Field(default=None, description="The ImpVM was created.")
    scheduled_at: datetime | None = Field(default=None, description="An agent claimed it.")
    booted_at: datetime | None = Field(default=None, description="Its runner process runs.")
    runner_online_at: datetime | None = Field(
        default=None,
        description="GitHub first listed its runner online, or its job started (a short job's "
        "runner may finish before any runner list shows it).",
    )
    job_queued_at: datetime | None = Field(
        default=None, description="impvm first saw its job queued."
    )
    job_started_at: datetime | None = Field(
        default=None, description="Its job went in progress (GitHub's started_at)."
    )
    finished_at: datetime | None = Field(default=None, description="Its runner exited.")


class ImpVMStatus(ApiModel):
    """Observed state of a VM."""

    phase: VMPhase | None = Field(default=None, description="Lifecycle phase.")
    node_name: str | None = Field(default=None, description="Node running the VM.")
    runner: RunnerStatus | None = None
    job: JobStatus | None = None
    started_at: datetime | None = Field(default=None, description="When the VM started.")
    finished_at: datetime | None = Field(default=None, description="When the VM stopped.")
    exit_code: int | None = Field(
        default=None,
        description=(
            "Exit status of the runner as its VM reported it (the job, root in the VM, can "
            "choose it): shown, never used to decide anything."
        ),
    )
    exit_reason: str | None = Field(
        default=None, description="Why the VM ended (Completed, Error, DeadlineExceeded, ...)."
    )
    message: str | None = Field(default=None, description="Detail (console tail on failure).")
    timings: VMTimings | None = Field(default=None, description="Per-job timings.")
    console_tail: str | None = Field(
        default=None,
        max_length=4000,
        description="A failed VM's last console lines (JIT config scrubbed).",
    )
    console_log: str | None = Field(
        default=None,
        max_length=1000,
        description="<node>:<path> of a failed VM's kept console (impvm logs prints it).",
    )
    conditions: list[Condition] | None = Field(
        default=None,
        description=_CONDITIONS_DESC,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class ImpVM(ApiModel):
    """A single-use runner VM."""

    kind: ClassVar[str] = "ImpVM"
    plural: ClassVar[str] = "impvms"
    short_names: ClassVar[list[str]] = ["impvm"]
    namespaced: ClassVar[bool] = True
    printer_columns: ClassVar[list[dict[str, Any]]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Node", "type": "string", "jsonPath": ".spec.nodeName"},
        {"name": "Runner", "type": "string", "jsonPath": ".status.runner.name"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    #: Fields a list/watch may select on (a node agent watches ``spec.nodeName=<node>`` and ``=``).
    selectable_fields: ClassVar[list[dict[str, str]]] = [{"jsonPath": ".spec.nodeName"}]

    spec: ImpVMSpec
    status: ImpVMStatus | None = None


#: Every kind, in the order the CRDs are rendered.
KINDS: tuple[type[ApiModel], ...] = (ImpVMClass, ImpVMTemplate, ImpVMRunnerPool, ImpVM)
