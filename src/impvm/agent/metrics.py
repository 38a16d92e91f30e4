"""Prometheus metrics of the node agent (prefix ``impvm_``), served on ``impvm agent
--metrics-address`` (loopback by default). Labels carry node, phase and resource names only."""

from __future__ import annotations

from prometheus_client import Gauge, Histogram

from impvm.agent.capacity import Resources

CAPACITY = Gauge(
    "impvm_agent_capacity",
    "What this agent offers VMs (resource: vcpu, memory_mib).",
    ["node", "resource"],
)
CAPACITY_USED = Gauge(
    "impvm_agent_capacity_used",
    "What the VMs bound to this agent hold (resource: vcpu, memory_mib).",
    ["node", "resource"],
)
VM_BOOT = Histogram(
    "impvm_vm_boot_seconds",
    "From the agent starting a VM to its runner process running (kernel, init, runner start).",
    ["node"],
    buckets=(0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120, 300),
)
VMS = Gauge("impvm_agent_vms", "VMs this agent holds state for.", ["node"])


def record_capacity(node: str, offered: Resources, used: Resources, vms: int) -> None:
    """Export the node's offered and used capacity and the VMs it holds."""
    for resource, total, held in (
        ("vcpu", offered.vcpu, used.vcpu),
        ("memory_mib", offered.memory_mib, used.memory_mib),
    ):
        CAPACITY.labels(node, resource).set(total)
        CAPACITY_USED.labels(node, resource).set(held)
    VMS.labels(node).set(vms)
