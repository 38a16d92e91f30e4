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

from impvm.agent.network.node import parse_resolvers
from impvm.agent.network.policy import (
    BLOCKED_RANGES,
    DEFAULT_LAYER,
    Allow,
    EgressLayer,
    PortRange,
    egress_layers,
    layer_verdict,
)
from impvm.agent.network.ruleset import (
    LOG_PREFIX_MAX,
    Attachment,
    NetConfig,
    NetConfigError,
    free_slot,
    log_prefix,
    merge_ports,
    render,
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
)
def test_the_kernel_accepts_every_rendered_table(
    scratch_netns: str, prefix: str, policies: list[tuple[EgressLayer, ...]], dns: list[str]
) -> None:
    cfg = NetConfig(ifprefix=prefix, dns=tuple(dns))
    atts = [_att(i * 7, ls, name=f"vm{i}") for i, ls in enumerate(policies)]
    out = subprocess.run(
        ["ip", "netns", "exec", scratch_netns, "nft", "-c", "-f", "-"],
        input=render(cfg, atts),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
