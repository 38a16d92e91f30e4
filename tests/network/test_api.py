"""The network fields on a real kube-apiserver: valid policies are stored as given, invalid ones
are rejected with a message naming the field."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from lightkube import Client
from lightkube.core.exceptions import ApiError

from impvm.api.resources import ImpVMClassResource

pytestmark = [pytest.mark.controlplane]


def _cls(network: dict[str, Any]) -> Any:
    return ImpVMClassResource.from_dict(
        {
            "apiVersion": "imp.dev/v1alpha1",
            "kind": "ImpVMClass",
            "metadata": {"name": f"net-{uuid.uuid4().hex[:8]}"},
            "spec": {"vcpu": 1, "memoryMiB": 512, "diskGiB": 1, "network": network},
        }
    )


def test_a_valid_policy_is_stored_with_its_defaults(kube: Client) -> None:
    obj = kube.create(
        _cls(
            {
                "egress": {
                    "policy": "allowlist",
                    "allow": [{"cidr": "10.1.0.0/16", "ports": [{"port": 5000}]}],
                }
            }
        )
    )
    try:
        egress = obj.to_dict()["spec"]["network"]["egress"]
        assert egress == {
            "policy": "allowlist",
            "audit": False,
            "allow": [{"cidr": "10.1.0.0/16", "ports": [{"protocol": "TCP", "port": 5000}]}],
        }
    finally:
        kube.delete(ImpVMClassResource, obj.metadata.name)


@pytest.mark.parametrize(
    ("egress", "message"),
    [
        ({"policy": "denyall"}, "spec.network.egress.policy"),
        ({"allow": [{"cidr": "fd00::/8"}]}, "must be an IPv4 CIDR"),
        ({"allow": [{"cidr": "10.0.0.0"}]}, "must be an IPv4 CIDR"),
        ({"allow": [{"cidr": "10.0.0.300/32"}]}, "must be an IPv4 CIDR"),
        ({"allow": [{"cidr": "10.0.0.1/8"}]}, "has host bits set"),
        (
            {"allow": [{"cidr": "10.0.0.0/8", "ports": [{"port": 90, "endPort": 80}]}]},
            "endPort must be at least port",
        ),
        (
            {"allow": [{"cidr": "10.0.0.0/8", "ports": [{"port": 0}]}]},
            "spec.network.egress.allow[0].ports[0].port",
        ),
        (
            {"allow": [{"cidr": "10.0.0.0/8", "ports": [{"port": 53, "protocol": "ICMP"}]}]},
            "protocol",
        ),
    ],
)
def test_an_invalid_policy_is_rejected_naming_the_field(
    kube: Client, egress: dict[str, Any], message: str
) -> None:
    with pytest.raises(ApiError) as err:
        kube.create(_cls({"egress": egress}))
    assert err.value.status.code == 422
    assert message in err.value.status.message, err.value.status.message
