"""The API's shared pieces: the group and version, the labels, annotations, finalizer and Secret
keys of the fixed interfaces, the patterns the schema checks, the VM phases, the base model
the kinds derive from, and CEL rules (:func:`cel`)."""

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
#: Finalizer a node agent puts on a VM bound to its node when it admits it; released once the
#: VM's runtime is cleaned up (or by the operator when the VM's node is lost).
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
#: Annotation the operator writes with ``spec.nodeName`` when it binds a VM: the size it bound
#: (``<vCPU>,<MiB>``). The node counts and starts the VM at that size, so a class resized or
#: deleted later changes neither side's count (like a pod's resources, fixed when scheduled).
#: Tenants cannot write ImpVMs and agents no annotation (deploy/admission/agent.yaml).
BOUND_SIZE_ANNOTATION = "imp.dev/bound-size"
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
