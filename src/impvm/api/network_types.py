"""The egress policy of a VM's network (ImpVMClass, ImpVMRunnerPool, ImpVM)."""

from typing import Any, ClassVar, Literal

from pydantic import Field

from impvm.api.meta import ApiModel, cel

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
