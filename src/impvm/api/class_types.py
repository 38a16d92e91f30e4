"""ImpVMClass (cluster-scoped): a VM size, its egress policy, and the namespaces that may use
it (like IngressClass and StorageClass restrictions)."""

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field

from impvm.api.meta import ApiModel, cel
from impvm.api.network_types import NetworkSpec

# --------------------------------------------------------------------------------------------
# ImpVMClass (cluster-scoped)

#: The label the API server puts on every namespace, holding its name (Kubernetes >= 1.21).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: A label value: empty, or at most 63 alphanumerics, '-', '_' and '.' (alphanumeric at both ends).
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A DNS subdomain (RFC 1123), e.g. a PriorityClass name.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
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


class Toleration(ApiModel):
    """A toleration of a node taint (Kubernetes core/v1 Toleration)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "self.operator != 'Exists' || !has(self.value) || self.value == ''",
            "scheduling.tolerations[].value must be empty when operator is Exists",
            ".value",
        ),
        cel(
            "self.operator == 'Exists' || (has(self.key) && self.key != '')",
            "scheduling.tolerations[].key must be set unless operator is Exists",
            ".key",
        ),
    ]

    key: str = Field(
        default="",
        max_length=317,
        pattern=f"^$|{_LABEL_KEY}",
        description="The taint key it tolerates; empty with operator Exists: every taint.",
    )
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="Equal or Exists.")
    value: str = Field(
        default="", max_length=63, pattern=_LABEL_VALUE, description="The taint value (Equal)."
    )
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        default="", description="The taint effect it tolerates; empty: every effect."
    )

    def wire(self) -> dict[str, Any]:
        """The toleration as a pod spec carries it (empty fields left out)."""
        out: dict[str, Any] = {"operator": self.operator}
        for name in ("key", "value", "effect"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out


class ClassScheduling(ApiModel):
    """Where the VMs of a class may run, as RuntimeClass's ``scheduling`` (Kubernetes
    node.k8s.io/v1): merged into each VM's pod, so the Kubernetes scheduler applies it. Used
    when the operator places VMs through VM pods (the chart's ``vmPods``)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "!has(self.nodeSelector) || self.nodeSelector.all(k, k.matches(r'" + _LABEL_KEY + "'))",
            "scheduling.nodeSelector keys must be label keys",
            ".nodeSelector",
        ),
        cel(
            "!has(self.nodeSelector) || self.nodeSelector.all(k, self.nodeSelector[k].matches(r'"
            + _LABEL_VALUE
            + "'))",
            "scheduling.nodeSelector values must be label values (at most 63 alphanumerics, "
            "'-', '_' or '.', alphanumeric at both ends)",
            ".nodeSelector",
        ),
    ]

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        alias="nodeSelector",
        description="Labels a node must have to run VMs of this class (added to the node pools' "
        "own selectors).",
        json_schema_extra={
            "maxProperties": 32,
            "additionalProperties": {"type": "string", "maxLength": 63},
        },
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Taints the VMs of this class tolerate (added to the node pools' own).",
    )
    priority_class_name: str = Field(
        default="",
        alias="priorityClassName",
        max_length=253,
        pattern=f"^$|{_DNS_SUBDOMAIN}",
        description="The PriorityClass of this class's VM pods (the scheduler's preemption and "
        "order); empty: the chart's vmPods.priorityClassName.",
    )


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
    scheduling: ClassScheduling | None = Field(
        default=None,
        description="Where its VMs may run (node labels, taints tolerated, priority), applied "
        "by the Kubernetes scheduler to each VM's pod.",
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
