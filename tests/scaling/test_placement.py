"""The operator's placement of unbound ImpVMs (impvm.scaling.placement): no node is given more
than it has free, only live nodes whose host checks passed get VMs, a node that overstates its
capacity gets its share and no more, and one namespace's queue never holds back another's."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.api.models import AGENT_FINALIZER, BOUND_SIZE_ANNOTATION
from impvm.api.vm import VM
from impvm.scaling.nodes import NodeLease
from impvm.scaling.placement import place, rooms, uses_capacity

NOW = dt.datetime(2026, 6, 1, 12, 0, tzinfo=dt.UTC)
SIZES = {"small": (1, 1024), "big": (4, 8192)}
_n = 0


def lease(
    node: str, vcpu: int | None = 8, mib: int | None = 16384, *, age: float = 1.0, ok: bool = True
) -> NodeLease:
    return NodeLease(
        node,
        NOW - dt.timedelta(seconds=age),
        40,
        vcpu,
        mib,
        0,
        0,
        preflight_ok=ok,
    )


def vm(
    namespace: str = "ns",
    *,
    node: str | None = None,
    cls: str = "small",
    created: float = 10.0,
    finalizer: bool = False,
    deleting: bool = False,
    phase: str | None = None,
    name: str | None = None,
    bound_size: str | None = None,
) -> VM:
    global _n
    _n += 1
    meta: dict[str, Any] = {
        "name": name or f"vm-{_n:05d}",
        "namespace": namespace,
        "uid": f"uid-{_n}",
        "resourceVersion": str(_n),
        "creationTimestamp": (NOW - dt.timedelta(seconds=created)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "finalizers": [AGENT_FINALIZER] if finalizer else [],
    }
    if deleting:
        meta["deletionTimestamp"] = meta["creationTimestamp"]
    if bound_size is not None:
        meta["annotations"] = {BOUND_SIZE_ANNOTATION: bound_size}
    spec: dict[str, Any] = {"classRef": {"name": cls}, "image": "reg/base@sha256:" + "0" * 64}
    if node is not None:
        spec["nodeName"] = node
    return VM.from_body(
        {"metadata": meta, "spec": spec, "status": {"phase": phase} if phase else {}}
    )


def test_vms_go_to_live_nodes_with_room_and_no_further() -> None:
    leases = [
        lease("a", 2, 4096),
        lease("dead", 64, 65536, age=120),
        lease("sick", 64, 65536, ok=False),
    ]
    waiting = [vm(created=30 - i) for i in range(4)]
    got = place(leases, NOW, waiting, SIZES)
    assert [b.node for b in got] == ["a", "a"]  # two fit; the dead and the failing node get none
    assert [b.name for b in got] == [waiting[0].name, waiting[1].name]  # oldest first


def test_a_node_that_overstates_its_capacity_gets_its_share_not_all() -> None:
    leases = [lease("liar", 10_000, 10_000_000), lease("honest", 4, 8192)]
    got = place(leases, NOW, [vm(created=i) for i in range(6)], SIZES)
    by_node = [b.node for b in got]
    assert by_node.count("liar") == 3 and by_node.count("honest") == 3


def test_a_node_that_ends_its_vms_at_once_gets_its_turn_not_every_vm() -> None:
    """A compromised node may fail its VMs and drop its finalizer at once to look empty; the
    spreading goes by the bindings each node was given lately, so it gets a quarter, as each
    honest node whose VMs run for ten rounds does."""
    leases = [lease(n, 8, 16384) for n in ("evil", "h1", "h2", "h3")]
    live: list[tuple[int, VM]] = []  # (round bound, VM) on honest nodes
    recent: Counter[str] = Counter()
    for round_ in range(40):
        live = [(r, v) for r, v in live if round_ - r < 10]
        (b,) = place(leases, NOW, [v for _, v in live] + [vm(created=0)], SIZES, recent)
        recent[b.node] += 1
        if b.node != "evil":  # honest VMs hold their room; the evil node's are gone at once
            live.append((round_, vm(node=b.node, finalizer=True, phase="Running")))
    assert recent["evil"] == 10, recent


def test_a_bound_vm_counts_at_the_size_it_was_bound_with() -> None:
    """The class was resized or deleted after the binding: the VM still counts at its bound
    size (the agent started it at that size)."""
    leases = [lease("a", 4, 8192)]
    shrunk = {"small": (1, 1024), "big": (1, 1024)}  # "big" was 4 vCPU when it was bound
    held = vm(node="a", cls="big", finalizer=True, phase="Running", bound_size="4,8192")
    assert place(leases, NOW, [held, vm()], shrunk) == ()
    orphan = vm(node="a", cls="gone", finalizer=True, phase="Running", bound_size="4,8192")
    assert place(leases, NOW, [orphan, vm()], SIZES) == ()
    (b,) = place(leases, NOW, [vm(cls="big")], SIZES)
    assert b.size == (4, 8192)  # the size the binding writes


def test_bound_vms_count_until_their_agent_releases_them() -> None:
    leases = [lease("a", 2, 4096)]
    held = [
        vm(node="a", finalizer=True, phase="Running"),  # running
        vm(node="a", phase="Scheduled"),  # bound, not taken by the agent yet
    ]
    released = [
        vm(node="a", phase="Succeeded"),  # finished, the agent released it
        vm(node="a", deleting=True),  # deleted before the agent took it
    ]
    assert [uses_capacity(v) for v in held + released] == [True, True, False, False]
    assert place(leases, NOW, [*held, vm()], SIZES) == ()
    assert len(place(leases, NOW, [*released, vm(), vm()], SIZES)) == 2


def test_one_namespace_with_many_waiting_vms_does_not_hold_back_another() -> None:
    noisy = [vm("noisy", created=100 + i) for i in range(50)]
    quiet = vm("quiet", created=1)
    got = place([lease("a", 2, 4096)], NOW, [*noisy, quiet], SIZES)
    assert {b.namespace for b in got} == {"noisy", "quiet"}


def test_what_cannot_be_placed_stays_unbound() -> None:
    leases = [lease("a", 2, 4096), lease("quiet", None, None)]  # no capacity advertised
    vms = [
        vm(cls="big"),  # bigger than any node
        vm(cls="gone"),  # class unknown
        vm(deleting=True),
        vm(phase="Failed"),
    ]
    assert place(leases, NOW, vms, SIZES) == ()
    assert place([], NOW, [vm()], SIZES) == ()


nodes = st.lists(
    st.builds(
        lease,
        st.sampled_from(["n1", "n2", "n3", "n4"]),
        st.integers(0, 8),
        st.integers(0, 16384),
        age=st.sampled_from([1.0, 100.0]),
        ok=st.booleans(),
    ),
    max_size=4,
    unique_by=lambda le: le.node,
)
vms = st.lists(
    st.builds(
        vm,
        st.sampled_from(["a", "b", "c"]),
        node=st.sampled_from([None, None, "n1", "n2", "n5"]),
        cls=st.sampled_from(["small", "big", "gone"]),
        created=st.integers(0, 100).map(float),
        finalizer=st.booleans(),
        deleting=st.booleans(),
        phase=st.sampled_from([None, "Scheduled", "Running", "Succeeded"]),
    ),
    max_size=30,
)


@given(nodes, vms)
@settings(max_examples=500, deadline=None)
def test_placement_never_overcommits_and_leaves_only_what_fits_nowhere(
    leases: list[NodeLease], seen: list[VM]
) -> None:
    got = place(leases, NOW, seen, SIZES)
    by_name = {(v.namespace, v.name): v for v in seen}
    assert len({(b.namespace, b.name) for b in got}) == len(got)  # each VM once
    free = rooms(leases, NOW, seen, SIZES)
    for b in got:
        v = by_name[(b.namespace, b.name)]
        assert not v.node_name and not v.deleting and not v.is_terminal
        assert b.resource_version == v.resource_version
        le = next(le for le in leases if le.node == b.node)
        assert le.live(NOW) and le.preflight_ok
        free[b.node] = free[b.node].take(*SIZES[v.class_name])
    # a node given VMs has room for them (one already over, by VMs bound before, gets none)
    assert all(free[b.node].vcpu >= 0 and free[b.node].memory_mib >= 0 for b in got)
    placed = {(b.namespace, b.name) for b in got}
    for v in seen:
        if v.node_name or v.deleting or v.is_terminal or v.class_name not in SIZES:
            continue
        if (v.namespace, v.name) not in placed:
            assert not any(r.fits(*SIZES[v.class_name]) for r in free.values())


def test_a_malformed_bound_size_is_ignored_and_an_unbound_vm_is_placed_at_its_class_size() -> None:
    """The annotation is read, never trusted: a value that is not two ASCII numbers within
    bounds counts as absent, and a VM not yet bound is placed at its class's size whatever it
    carries."""
    for raw in ("²,1", "1,²", "-1,5", "1", "", "99999,1", "1,123456789", " 1,1"):
        assert vm(node="a", bound_size=raw).bound_size is None, raw
    leases = [lease("a", 4, 8192)]
    held = vm(node="a", cls="big", finalizer=True, phase="Running", bound_size="²,1")
    assert place(leases, NOW, [held, vm()], SIZES) == ()  # counted at its class's 4 vCPU
    (b,) = place(leases, NOW, [vm(cls="big", bound_size="1,1")], SIZES)
    assert b.size == (4, 8192)
