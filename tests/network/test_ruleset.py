"""The pure network plan: names, slots and addresses, port merging, log prefixes, records, the
layers from the API, the reference semantics, and the rendered table - which the real nft
accepts (``nft -c`` in a namespace made for the check) for any generated policy."""

from __future__ import annotations

import ipaddress
import itertools
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impvm.agent.network.cluster import (
    ClusterRanges,
    from_node,
    from_pod,
    from_service_cidr,
    from_settings,
    split_resolvers,
)
from impvm.agent.network.node import parse_resolvers
from impvm.agent.network.plan import Attachment, NetConfig, NetConfigError, free_slot
from impvm.agent.network.policy import (
    BLOCKED_RANGES,
    DEFAULT_LAYER,
    Allow,
    EgressLayer,
    PortRange,
    egress_layers,
    layer_verdict,
    names_protected,
)
from impvm.agent.network.ruleset import (
    LOG_PREFIX_MAX,
    log_prefix,
    merge_ports,
    render,
    vm_chain_rules,
)
from impvm.api.models import EgressPolicy, NetworkSpec

prefixes = st.from_regex(r"\A[a-z][a-z0-9]{0,7}\Z")
ports = st.builds(
    lambda proto, a, n: PortRange(proto, a, min(a + n, 65535)),
    st.sampled_from(["tcp", "udp"]),
    st.integers(1, 65535),
    st.integers(0, 300),
)
cidrs = st.builds(
    lambda addr, plen: str(
        ipaddress.IPv4Network(f"{ipaddress.IPv4Address(addr)}/{plen}", strict=False)
    ),
    st.integers(0, 2**32 - 1),
    st.integers(0, 32),
)
allows = st.builds(Allow, cidrs, st.lists(ports, max_size=4).map(tuple))
layers = st.builds(
    EgressLayer,
    st.sampled_from(["class", "vm"]),
    st.sampled_from(["public", "allowlist"]),
    st.lists(allows, max_size=4).map(tuple),
    st.booleans(),
)
names = st.from_regex(r"\A[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


def _att(
    slot: int, layers: tuple[EgressLayer, ...] = (), kind: str = "tap", name: str = "vm"
) -> Attachment:
    return Attachment(f"ns.{name}.{slot:08d}", "ns", name, slot, kind, layers, f"/w/{slot}")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"table": "Bad-Name"}, "network table"),
        ({"ifprefix": "toolongprefix"}, "interface prefix"),
        ({"ifprefix": "a-b"}, "interface prefix"),
        ({"subnet": "10.0.0.0/8"}, "prefix length"),
        ({"subnet": "10.0.0.0/30"}, "prefix length"),
        ({"subnet": "10.0.0.1/24"}, "guest subnet"),
        ({"dns": ("fd00::1",)}, "guest DNS resolver"),
        ({"protected": ("10.96.0.0/33",)}, "protected network"),
        ({"protected": ("fd00::/8",)}, "protected network"),
    ],
)
def test_bad_settings_name_the_setting(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(NetConfigError, match=field):
        NetConfig(**kwargs)  # type: ignore[arg-type]


@given(prefixes, prefixes, st.integers(0, 16383))
def test_interface_names_fit_and_another_prefix_never_matches_ours(
    p: str, q: str, slot: int
) -> None:
    cfg = NetConfig(ifprefix=p)
    name = cfg.ifname(slot)
    assert len(name) <= 15 and cfg.slot_of(name) == slot
    if p != q:  # nft's wildcard "<p>-*" is a string prefix match
        assert not NetConfig(ifprefix=q).ifname(slot).startswith(f"{p}-")
        assert cfg.slot_of(NetConfig(ifprefix=q).ifname(slot)) is None


@pytest.mark.parametrize(
    "name", ["impvm-01", "impvm-", "impvm-x", "impvmx-1", "eth0", "impvm-16384"]
)
def test_names_that_are_not_ours(name: str) -> None:
    assert NetConfig().slot_of(name) is None


@given(st.sampled_from(["10.213.0.0/16", "10.200.7.0/24", "192.168.4.16/28"]), st.data())
def test_slots_are_distinct_aligned_30s_inside_the_subnet(subnet: str, data: st.DataObject) -> None:
    cfg = NetConfig(subnet=subnet)
    s1 = data.draw(st.integers(0, cfg.slots - 1))
    s2 = data.draw(st.integers(0, cfg.slots - 1))
    net = ipaddress.IPv4Network(subnet)
    for s in (s1, s2):
        gw, guest = (
            ipaddress.IPv4Address(cfg.gateway(s)),
            ipaddress.IPv4Address(cfg.guest_address(s)),
        )
        link = ipaddress.IPv4Network(f"{gw}/30", strict=False)
        assert gw in net and guest in net and guest in link and link.subnet_of(net)
        assert gw != link.network_address and guest != link.broadcast_address
    if s1 != s2:
        assert {cfg.gateway(s1), cfg.guest_address(s1)}.isdisjoint(
            {cfg.gateway(s2), cfg.guest_address(s2)}
        )


def test_free_slot_is_the_lowest_free_one() -> None:
    assert free_slot([], 4) == 0
    assert free_slot([0, 1, 3], 4) == 2
    assert free_slot([0, 1, 2, 3], 4) is None


@given(st.lists(ports, max_size=12))
def test_merged_ports_cover_exactly_the_same_ports_without_overlap(rs: list[PortRange]) -> None:
    merged = merge_ports(rs)
    for proto in ("tcp", "udp"):
        want = {p for r in rs if r.protocol == proto for p in range(r.first, r.last + 1)}
        spans = merged.get(proto, [])
        assert {p for f, last in spans for p in range(f, last + 1)} == want
        assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(spans))


@given(st.sampled_from(["class", "vm"]), names.filter(lambda n: len(n) <= 63), names)
def test_log_prefix_fits_nf_log_and_names_the_vm(layer: str, ns: str, name: str) -> None:
    p = log_prefix(layer, ns, name)
    assert len(p.encode()) <= LOG_PREFIX_MAX and p.endswith(": ")
    assert p.startswith(f"impvm audit {layer} {ns}/{name[:20]}")


@given(
    st.lists(layers, max_size=2).map(tuple),
    st.integers(0, 16383),
    st.sampled_from(["tap", "netns"]),
)
def test_records_round_trip(ls: tuple[EgressLayer, ...], slot: int, kind: str) -> None:
    a = _att(slot, ls, kind)
    assert Attachment.from_json(a.to_json()) == a


def test_layers_from_the_api_class_first_then_the_vm() -> None:
    assert egress_layers(None, None) == (DEFAULT_LAYER,)
    assert egress_layers(NetworkSpec(), None) == (DEFAULT_LAYER,)
    vm = NetworkSpec(
        egress=EgressPolicy.model_validate(
            {
                "policy": "allowlist",
                "allow": [{"cidr": "10.1.2.3/8", "ports": [{"port": 53, "protocol": "UDP"}]}],
            }
        )
    )
    cls = NetworkSpec(egress=EgressPolicy(audit=True))
    assert egress_layers(cls, vm) == (
        EgressLayer("class", "public", (), True),
        EgressLayer("vm", "allowlist", (Allow("10.0.0.0/8", (PortRange("udp", 53, 53),)),), False),
    )


@pytest.mark.parametrize(
    ("layer", "dst", "proto", "port", "want"),
    [
        (DEFAULT_LAYER, "203.0.113.9", "tcp", 443, "accept"),
        (DEFAULT_LAYER, "169.254.169.254", "tcp", 80, "reject"),
        (DEFAULT_LAYER, "10.9.9.9", "udp", 53, "reject"),
        (DEFAULT_LAYER, "100.64.0.1", "tcp", 1, "reject"),
        (DEFAULT_LAYER, "127.0.0.1", "tcp", 1, "reject"),
        (DEFAULT_LAYER, "239.1.1.1", "udp", 5353, "reject"),
        (EgressLayer("class", audit=True), "192.168.1.1", "tcp", 22, "log"),
        (
            EgressLayer("class", allow=(Allow("10.1.0.0/16", (PortRange("tcp", 5000, 5001),)),)),
            "10.1.2.3",
            "tcp",
            5001,
            "accept",
        ),
        (
            EgressLayer("class", allow=(Allow("10.1.0.0/16", (PortRange("tcp", 5000, 5001),)),)),
            "10.1.2.3",
            "udp",
            5001,
            "reject",
        ),
        (EgressLayer("vm", "allowlist"), "203.0.113.9", "tcp", 443, "reject"),
        (
            EgressLayer("vm", "allowlist", (Allow("203.0.113.0/24"),)),
            "203.0.113.9",
            None,
            None,
            "accept",
        ),
        (
            EgressLayer(
                "vm", "allowlist", (Allow("203.0.113.0/24", (PortRange("tcp", 443, 443),)),)
            ),
            "203.0.113.9",
            None,
            None,
            "reject",
        ),
    ],
)
def test_reference_semantics(
    layer: EgressLayer, dst: str, proto: str | None, port: int | None, want: str
) -> None:
    assert layer_verdict(layer, dst, proto, port) == want


def test_every_private_link_local_cgnat_and_loopback_range_is_blocked_by_default() -> None:
    for net in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
    ):
        assert net in BLOCKED_RANGES


def test_render_has_one_chain_per_vm_and_layer_and_is_deterministic() -> None:
    cfg = NetConfig(dns=("203.0.113.53",))
    atts = [_att(3, (DEFAULT_LAYER, EgressLayer("vm", "allowlist"))), _att(1, (), name="other")]
    text = render(cfg, atts)
    assert text == render(cfg, list(reversed(atts)))
    assert text.startswith("table inet impvm {}\ndelete table inet impvm\n")
    for chain in ("vm-1 {", "vm-1-0 {", "vm-3 {", "vm-3-0 {", "vm-3-1 {"):
        assert f"chain {chain}" in text
    assert "vm-1-1" not in text
    assert '"impvm-1" : jump vm-1, "impvm-3" : jump vm-3' in text
    assert "ip saddr != 10.213.0.14 drop" in text  # slot 3's guest only
    assert "chain vm-" not in render(cfg, []) and "elements" not in render(cfg, [])
    assert text.count("ip daddr 203.0.113.53 udp dport 53 accept") == 3  # input + both VMs


parse_cases = [
    ("nameserver 127.0.0.53\noptions edns0\n", []),
    (
        "# x\nnameserver 10.255.255.53\nnameserver fd00::1\nnameserver 10.255.255.53\nnameserver 1.1.1.1\n",
        ["10.255.255.53", "1.1.1.1"],
    ),
]


@pytest.mark.parametrize(("text", "want"), parse_cases)
def test_resolvers_for_guests_skip_loopback_and_ipv6(text: str, want: list[str]) -> None:
    assert parse_resolvers(text) == want


@pytest.fixture(scope="module")
def scratch_netns() -> Iterator[str]:
    """A namespace where ``nft -c`` checks rulesets against the kernel."""
    name = f"impvm-nftcheck-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prefixes,
    st.lists(st.lists(layers, max_size=2).map(tuple), max_size=4),
    st.lists(
        st.integers(0, 2**32 - 1).map(lambda i: str(ipaddress.IPv4Address(i))),
        max_size=3,
        unique=True,
    ),
    st.lists(cidrs, max_size=5),
)
def test_the_kernel_accepts_every_rendered_table(
    scratch_netns: str,
    prefix: str,
    policies: list[tuple[EgressLayer, ...]],
    dns: list[str],
    protected: list[str],
) -> None:
    cfg = NetConfig(ifprefix=prefix, dns=tuple(dns), protected=tuple(protected))
    atts = [_att(i * 7, ls, name=f"vm{i}") for i, ls in enumerate(policies)]
    out = subprocess.run(
        ["ip", "netns", "exec", scratch_netns, "nft", "-c", "-f", "-"],
        input=render(cfg, atts),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------ protected networks

NODE = "192.0.2.10/32"  # a node's public address
SERVICES = "10.96.0.0/12"
PROTECTED = (NODE, SERVICES, "10.244.0.0/16")


def test_protected_networks_are_collapsed_and_keep_resolvers_inside_them_from_guests() -> None:
    cfg = NetConfig(
        dns=("10.96.0.10", "203.0.113.53"),
        protected=("10.96.0.0/13", "10.104.0.0/13", "192.0.2.10", "192.0.2.10/32"),
    )
    assert cfg.protected == ("10.96.0.0/12", "192.0.2.10/32")
    assert cfg.reachable_dns == ("203.0.113.53",)  # never the cluster's DNS
    text = render(cfg, [_att(0)])
    assert "10.96.0.10" not in text
    assert text.count("ip daddr 203.0.113.53 udp dport 53 accept") == 2


@pytest.mark.parametrize(
    ("allow", "dst", "port", "named"),
    [
        ((), "192.0.2.10", 10250, False),  # the node: never by default
        ((Allow("0.0.0.0/0"),), "192.0.2.10", 22, False),  # "everything" does not name it
        ((Allow("10.0.0.0/8"),), "10.96.0.1", 443, False),  # nor a wide private range
        ((Allow("10.0.0.0/8"),), "10.20.0.5", 5000, True),  # whose rest it opens
        ((Allow("10.96.0.10/32", (PortRange("udp", 53, 53),)),), "10.96.0.10", 53, True),
        ((Allow("10.96.0.10/32", (PortRange("udp", 53, 53),)),), "10.96.0.10", 54, False),
        ((Allow("192.0.2.10/32", (PortRange("tcp", 30080, 30080),)),), "192.0.2.10", 30080, True),
        ((Allow("192.0.2.0/24"),), "192.0.2.10", 10250, False),  # wider than the node address
        ((), "203.0.113.7", 443, True),  # outside: not this rule's business
    ],
)
def test_only_an_entry_inside_the_protected_networks_opens_them(
    allow: tuple[Allow, ...], dst: str, port: int, named: bool
) -> None:
    proto = "udp" if port in (53, 54) else "tcp"
    assert (
        names_protected((EgressLayer("class", allow=allow),), PROTECTED, dst, proto, port) is named
    )
    # every layer must name it; audit opens nothing here
    both = (EgressLayer("class", allow=allow), EgressLayer("vm", "allowlist", audit=True))
    outside = dst in ("10.20.0.5", "203.0.113.7")
    assert names_protected(both, PROTECTED, dst, proto, port) is outside


def test_guard_chains_reject_the_protected_networks_unless_named() -> None:
    cfg = NetConfig(protected=PROTECTED)
    named = EgressLayer("class", allow=(Allow("10.96.0.10/32", (PortRange("udp", 53, 53),)),))
    text = render(cfg, [_att(0), _att(1, (named,)), _att(2, (named, EgressLayer("vm")))])
    assert (
        "set protected {" in text
        and "elements = { 10.96.0.0/12, 10.244.0.0/16, 192.0.2.10/32 }" in text
    )
    rules = {i: vm_chain_rules(cfg, _att(i, layers)) for i, layers in
             ((0, ()), (1, (named,)), (2, (named, EgressLayer("vm")))) }  # fmt: skip
    reject = "ip daddr @protected reject with icmpx type admin-prohibited"
    assert reject in rules[0]
    assert "ip daddr @protected jump vm-1-p0" in rules[1] and reject not in rules[1]
    at = rules[2].index("ip daddr @protected jump vm-2-p0")
    assert rules[2][at + 1] == reject  # the vm layer names none of them
    assert "chain vm-1-p0 {\n    ip daddr 10.96.0.10/32 udp dport 53 return\n" in text
    # before any layer: a wide allow in a layer never reaches the protected networks
    for r in rules.values():
        assert r.index(next(x for x in r if "@protected" in x)) < r.index(
            next(x for x in r if x.startswith("jump vm-"))
        )


@given(
    st.lists(allows, max_size=4),
    st.integers(0, 2**32 - 1).map(lambda i: str(ipaddress.IPv4Address(i))),
    st.sampled_from(["tcp", "udp"]),
    st.integers(1, 65535),
)
def test_what_names_a_protected_network_lies_inside_it(
    entries: list[Allow], dst: str, proto: str, port: int
) -> None:
    """The property: a protected destination passes only through an entry inside the
    protected networks that matches it; nothing outside them is held back."""
    layer = EgressLayer("class", allow=tuple(entries))
    inside = [
        a for a in entries
        if any(ipaddress.IPv4Network(a.cidr).subnet_of(ipaddress.IPv4Network(p)) for p in PROTECTED)
    ]  # fmt: skip
    addr = ipaddress.IPv4Address(dst)
    in_protected = any(addr in ipaddress.IPv4Network(p) for p in PROTECTED)
    got = names_protected((layer,), PROTECTED, dst, proto, port)
    if not in_protected:
        assert got
    else:
        assert got == any(
            addr in ipaddress.IPv4Network(a.cidr)
            and (
                not a.ports
                or any(p.protocol == proto and p.first <= port <= p.last for p in a.ports)
            )
            for a in inside
        )


def test_the_pod_tells_the_nodes_addresses_the_kubernetes_service_and_the_clusters_dns() -> None:
    env = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "HOST_IPS": "192.0.2.10,2001:db8::10",
        "HOST_IP": "192.0.2.99",
    }
    resolv = "search impvm-system.svc.cluster.local svc.cluster.local\nnameserver 10.96.0.10\n"
    got = from_pod(env, resolv)
    assert got == ClusterRanges(
        nodes=("192.0.2.10/32",), services=("10.96.0.1/32",), dns=("10.96.0.10/32",)
    )
    assert from_pod({"HOST_IPS": "192.0.2.10"}, resolv) == ClusterRanges()  # not in a pod
    assert from_pod({**env, "HOST_IPS": ""}, "").nodes == ("192.0.2.99/32",)


def test_nodes_and_service_cidrs_give_addresses_and_networks_ipv4_only() -> None:
    node = {
        "metadata": {"name": "n1"},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:10::/64"]},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": "10.0.5.4"},
                {"type": "ExternalIP", "address": "198.51.100.4"},
                {"type": "InternalIP", "address": "fd00::4"},
                {"type": "Hostname", "address": "n1"},
            ]
        },
    }
    assert from_node(node) == ClusterRanges(
        nodes=("10.0.5.4/32", "198.51.100.4/32"), pods=("10.244.1.0/24",)
    )
    assert from_node({"metadata": {"name": "bare"}}) == ClusterRanges()
    svc = {"spec": {"cidrs": ["10.96.0.0/12", "fd00:96::/112"]}}
    assert from_service_cidr(svc) == ClusterRanges(services=("10.96.0.0/12",))
    every = from_node(node).union(from_service_cidr(svc), from_node(node))
    assert every.protected() == ("10.0.5.4/32", "10.96.0.0/12", "10.244.1.0/24", "198.51.100.4/32")
    assert "nodes 10.0.5.4/32, 198.51.100.4/32; pods 10.244.1.0/24" in every.describe()


def test_settings_name_the_flag_of_a_bad_network() -> None:
    assert from_settings(pods=["10.244.0.0/16"], dns=["10.96.0.10"]) == ClusterRanges(
        pods=("10.244.0.0/16",), dns=("10.96.0.10/32",)
    )
    with pytest.raises(NetConfigError, match="--service-cidr 'x'"):
        from_settings(services=["x"])
    keep, drop = split_resolvers(["10.96.0.10", "1.1.1.1"], ["10.96.0.0/12"])
    assert (keep, drop) == (["1.1.1.1"], ["10.96.0.10"])
