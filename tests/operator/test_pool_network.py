"""A pool's network (egress policy) reaches its VMs: the operator copies it into each VM it
creates, where the agent applies it on top of the class's; a VM's network cannot change later."""

from __future__ import annotations

import pytest
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from impvm.agent.network.policy import Allow, EgressLayer, PortRange, egress_layers
from impvm.api.models import ImpVM, ImpVMClass
from impvm.api.resources import ImpVMClassResource, ImpVMResource, ImpVMRunnerPoolResource

from .conftest import POOL, PoolEnv

NETWORK = {
    "egress": {
        "policy": "allowlist",
        "audit": True,
        "allow": [
            {"cidr": "203.0.113.0/24", "ports": [{"port": 443}, {"port": 8000, "endPort": 8100}]}
        ],
    }
}


async def test_pool_network_is_copied_to_each_vm_and_fixed_there(env: PoolEnv) -> None:
    await env.ready_pool(minIdle=1)
    await env.kube.patch(
        ImpVMRunnerPoolResource, POOL, {"spec": {"network": NETWORK}}, namespace=env.ns,
        patch_type=PatchType.MERGE,
    )  # fmt: skip
    await env.kube.patch(
        ImpVMClassResource, env.class_name,
        {"spec": {"network": {"egress": {"allow": [{"cidr": "169.254.169.254/32"}]}}}},
        patch_type=PatchType.MERGE,
    )  # fmt: skip
    await env.run_pass()
    (vm,) = await env.vms()
    assert vm["spec"]["network"] == {
        "egress": {
            "policy": "allowlist",
            "audit": True,
            "allow": [
                {
                    "cidr": "203.0.113.0/24",
                    "ports": [
                        {"protocol": "TCP", "port": 443},
                        {"protocol": "TCP", "port": 8000, "endPort": 8100},
                    ],
                }
            ],
        }
    }
    # what the agent enforces for it: the class's layer, then the pool's
    cls = ImpVMClass.model_validate(
        (await env.kube.get(ImpVMClassResource, env.class_name)).to_dict()
    )
    layers = egress_layers(cls.spec.network, ImpVM.model_validate(vm).spec.network)
    assert layers == (
        EgressLayer("class", "public", (Allow("169.254.169.254/32"),), False),
        EgressLayer(
            "vm",
            "allowlist",
            (Allow("203.0.113.0/24", (PortRange("tcp", 443, 443), PortRange("tcp", 8000, 8100))),),
            True,
        ),
    )
    with pytest.raises(ApiError) as err:
        await env.kube.patch(
            ImpVMResource, vm["metadata"]["name"],
            {"spec": {"network": {"egress": {"policy": "public"}}}},
            namespace=env.ns, patch_type=PatchType.MERGE,
        )  # fmt: skip
    assert "network cannot be changed once the VM exists" in err.value.status.message
