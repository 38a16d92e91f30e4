"""Placement through the Kubernetes scheduler (impvm.scaling.vmpods): every VM that waits or
holds a node gets exactly one pod, a VM is bound only to the node its pod was scheduled to and
only while that node's agent is live and passed its checks, pods on bad nodes are remade away
from them, and pods of ended or vanished VMs go."""

from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.api.models import ClassScheduling
from impvm.operator.manifests import get_vm_pod
from impvm.scaling.placement import Binding, uses_capacity
from impvm.scaling.settings import VMPodSettings
from impvm.scaling.vmpods import (
    VM_POD_UID_LABEL,
    CreatePod,
    DeletePod,
    Unschedulable,
    VMPod,
    plan_vm_pods,
    vm_pod_name,
)
from tests.scaling.test_placement import NOW, SIZES, lease, vm

GRACE = 60.0
OWNER = "uid-of-the-vm-pods-configmap"


def pod(v: Any, node: str | None = None, **kw: Any) -> VMPod:
    ago = kw.pop("scheduled_ago", 1.0)
    scheduled = NOW - dt.timedelta(seconds=ago) if node else None
    kw.setdefault("owner_uid", OWNER)
    return VMPod(vm_pod_name(v.uid), v.uid, node, scheduled_at=scheduled, **kw)


def plan(vms: list[Any], pods: list[VMPod], leases: list[Any]) -> tuple[Any, ...]:
    return plan_vm_pods(vms, pods, leases, NOW, SIZES, GRACE, OWNER)


def test_a_waiting_vm_gets_a_pod_kept_from_bad_nodes_then_is_bound_where_it_was_scheduled() -> None:
    leases = [lease("a"), lease("dead", age=200), lease("sick", ok=False)]
    v = vm()
    (create,) = plan([v], [], leases)
    assert create == CreatePod(v, (1, 1024), None, ("sick", "dead"))  # renewed last first
    assert plan([v], [pod(v)], leases) == ()  # not yet scheduled: wait
    (bind,) = plan([v], [pod(v, "a")], leases)
    assert bind == Binding("ns", v.name, v.resource_version, "a", (1, 1024))


def test_a_pod_on_a_node_whose_agent_is_bad_or_absent_is_remade() -> None:
    v = vm()
    leases = [lease("a"), lease("dead", age=200), lease("sick", ok=False), lease("late", age=70)]
    for node in ("dead", "sick"):
        (act,) = plan([v], [pod(v, node)], leases)
        assert isinstance(act, DeletePod) and act.name == vm_pod_name(v.uid)
    # a late Lease (within the grace) and a node with no Lease yet (a new node): wait
    assert plan([v], [pod(v, "late")], leases) == ()
    assert plan([v], [pod(v, "new", scheduled_ago=30)], leases) == ()
    (act,) = plan([v], [pod(v, "new", scheduled_ago=GRACE + 1)], leases)
    assert isinstance(act, DeletePod) and "no agent on node new" in act.reason


def test_a_pod_the_kubelet_refused_is_remade_and_one_the_scheduler_cannot_place_is_told() -> None:
    v = vm()
    (act,) = plan([v], [pod(v, "a", phase="Failed")], [lease("a")])
    assert isinstance(act, DeletePod)
    msg = "0/2 nodes are available: 2 Insufficient cpu."
    (act,) = plan([v], [pod(v, unschedulable=msg)], [lease("a")])
    assert act == Unschedulable("ns", v.name, v.uid, msg)


def test_a_vm_waits_for_room_in_what_its_nodes_agent_offers_then_is_rescheduled() -> None:
    """The scheduler counts allocatable cores; the agent may offer less: a VM is bound only
    when the agent has room, so it never fails OutOfCapacity."""
    running = vm(node="a", finalizer=True)
    first, second = vm(created=20), vm(created=10)
    leases = [lease("a", 2, 4096)]
    pods = [pod(running, "a"), pod(first, "a"), pod(second, "a", scheduled_ago=5)]
    acts = plan([running, first, second], pods, leases)
    assert acts == (Binding("ns", first.name, first.resource_version, "a", (1, 1024)),)
    late = [pod(running, "a"), pod(first, "a"), pod(second, "a", scheduled_ago=GRACE + 1)]
    acts = plan([running, first, second], late, leases)
    assert isinstance(acts[1], DeletePod) and "no room" in acts[1].reason


def test_a_pod_the_operator_did_not_make_binds_nothing_whatever_its_name_and_labels() -> None:
    """A compromised node's kubelet may make a mirror pod in any namespace, with any name and
    labels, bound to itself: made before the operator's, it must not bind the VM there."""
    v = vm()
    body = {
        "metadata": {
            "name": vm_pod_name(v.uid),
            "labels": {"app.kubernetes.io/component": "vm", VM_POD_UID_LABEL: v.uid},
            "annotations": {"kubernetes.io/config.mirror": "x", "imp.dev/vm": f"ns/{v.name}"},
            "ownerReferences": [{"kind": "Node", "name": "evil", "uid": "n", "controller": True}],
        },
        "spec": {"nodeName": "evil"},
        "status": {"phase": "Running"},
    }
    mirror = VMPod.from_body(body)
    assert mirror.mirror and mirror.owner_uid == ""
    leases = [lease("good"), lease("evil")]
    assert plan([v], [mirror], leases) == (CreatePod(v, (1, 1024), None, ()),)
    # our owner's uid copied onto a mirror pod: still a kubelet's pod
    forged = VMPod.from_body(
        {**body, "metadata": {**body["metadata"], "ownerReferences": [
            {"kind": "ConfigMap", "name": "impvm-vm-pods", "uid": OWNER, "controller": True}]}}
    )  # fmt: skip
    assert forged.owner_uid == OWNER and forged.mirror
    assert plan([v], [forged], leases) == (CreatePod(v, (1, 1024), None, ()),)
    # and without an owner at all (someone with pod rights in the namespace)
    plain = pod(v, "evil", owner_uid="")
    assert plan([v], [plain], leases) == (CreatePod(v, (1, 1024), None, ()),)
    # no owner known (not read yet): no pod is taken for a VM pod, none is deleted
    assert not [
        a
        for a in plan_vm_pods([v], [pod(v, "good")], leases, NOW, SIZES, GRACE, "")
        if not isinstance(a, CreatePod)
    ]


def test_the_nodes_kept_away_are_those_whose_agent_died_last_and_pods_bind_at_their_size() -> None:
    stale = [lease(f"aaa-gone-{i:02d}", age=99999) for i in range(70)]
    leases = [*stale, lease("zz-just-died", age=200), lease("ok")]
    (create,) = plan([vm()], [], leases)
    assert isinstance(create, CreatePod) and create.avoid[0] == "zz-just-died"
    assert len(create.avoid) == 64
    v = vm()  # its class was resized after its pod was made: bound at what the pod requested
    (bind,) = plan([v], [pod(v, "ok", size=(2, 3000))], leases)
    assert isinstance(bind, Binding) and bind.size == (2, 3000)


def test_a_pod_of_a_vm_the_caches_do_not_show_is_deleted_only_once_the_vm_is_confirmed_gone() -> (
    None
):
    v = vm()
    p = pod(v, "a", vm=("ns", v.name, v.uid))
    (act,) = plan([], [p], [lease("a")])
    assert act == DeletePod(p.name, "its ImpVM is gone", ("ns", v.name, v.uid))


def test_bound_vms_keep_a_pinned_pod_until_they_end() -> None:
    running = vm(node="a", finalizer=True)
    (create,) = plan([running], [], [lease("a")])
    assert create == CreatePod(running, (1, 1024), "a", ())
    assert plan([running], [pod(running, "a", phase="Running")], [lease("a")]) == ()
    # a pod on another node than its VM's (remade by hand): deleted, made again pinned
    (act,) = plan([running], [pod(running, "b")], [lease("a")])
    assert isinstance(act, DeletePod)
    ended = vm(node="a", phase="Succeeded")  # released by its agent
    (act,) = plan([ended], [pod(ended, "a")], [lease("a")])
    assert isinstance(act, DeletePod) and "ended" in act.reason
    gone = vm(node="a", finalizer=True)
    (act,) = plan([], [pod(gone, "a")], [lease("a")])
    assert isinstance(act, DeletePod) and "gone" in act.reason


def test_nothing_is_done_twice_to_a_pod_being_deleted_nor_to_pods_not_named_for_their_vm() -> None:
    v = vm()
    assert plan([v], [pod(v, "a", deleting=True)], [lease("a")]) == ()
    stranger = VMPod("not-its-name", v.uid, "a", owner_uid=OWNER)  # named for no VM
    acts = plan([v], [stranger], [lease("a")])
    assert CreatePod(v, (1, 1024), None, ()) in acts
    assert not any(isinstance(a, Binding) for a in acts)


nodes = st.sampled_from(["a", "b", "dead", "sick", "new"])


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[Any], list[VMPod]]:
    vms, pods = [], []
    for _ in range(draw(st.integers(0, 8))):
        bound = draw(st.booleans())
        v = vm(
            node=draw(nodes) if bound else None,
            cls=draw(st.sampled_from(["small", "big", "unknown"])),
            finalizer=draw(st.booleans()),
            deleting=draw(st.booleans()),
            phase=draw(st.sampled_from([None, "Running", "Succeeded", "Failed"])),
        )
        if draw(st.booleans()):
            vms.append(v)
        if draw(st.booleans()):
            pods.append(
                pod(
                    v,
                    draw(st.one_of(st.none(), nodes)),
                    phase=draw(st.sampled_from(["Pending", "Running", "Failed"])),
                    deleting=draw(st.booleans()),
                    scheduled_ago=draw(st.floats(0, 300)),
                )
            )
    return vms, pods


@settings(max_examples=500, deadline=None)
@given(worlds())
def test_one_action_per_vm_bindings_only_to_scheduled_live_nodes(
    world: tuple[list[Any], list[VMPod]],
) -> None:
    vms, pods = world
    leases = [lease("a"), lease("b"), lease("dead", age=200), lease("sick", ok=False)]
    acts = plan(vms, pods, leases)
    by_uid = {p.vm_uid: p for p in pods}
    touched: list[str] = []
    for a in acts:
        if isinstance(a, Binding):
            v = next(x for x in vms if x.name == a.name)
            assert not v.node_name and by_uid[v.uid].node_name == a.node in ("a", "b")
            touched.append(v.uid)
        elif isinstance(a, CreatePod):
            assert a.vm.uid not in by_uid
            touched.append(a.vm.uid)
        elif isinstance(a, DeletePod):
            p = next(x for x in pods if x.name == a.name)
            assert not p.deleting
            touched.append(p.vm_uid)
        else:
            touched.append(a.uid)
    assert len(touched) == len(set(touched))
    made = {a.vm.uid for a in acts if isinstance(a, CreatePod)}
    for v in vms:
        waits = not (v.node_name or v.deleting or v.is_terminal) and v.class_name in SIZES
        if (waits or uses_capacity(v)) and v.uid not in by_uid:
            assert v.uid in made  # every VM that needs a pod gets one
        elif v.uid in made:
            raise AssertionError(f"a pod for {v.name}, which needs none or has one")


def test_the_pod_holds_the_vm_size_for_the_scheduler_and_carries_the_class_scheduling() -> None:
    settings_ = VMPodSettings.model_validate(
        {
            "image": "reg/impvm-agent@sha256:" + "1" * 64,
            "overheadMiB": 100,
            "nodeSelectors": [{"pool": "small"}, {"pool": "large"}],
            "tolerations": [{"key": "imp.dev/vm-host", "operator": "Exists"}],
            "priorityClassName": "vms",
        }
    )
    scheduling = ClassScheduling.model_validate(
        {
            "nodeSelector": {"zone": "z1"},
            "tolerations": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}],
            "priorityClassName": "urgent",
        }
    )
    v = vm(cls="big")
    body = get_vm_pod(
        CreatePod(v, (4, 8192), None, ("sick",)), settings_, scheduling, "impvm", OWNER
    )
    (owner,) = body["metadata"]["ownerReferences"]
    assert owner["kind"] == "ConfigMap" and owner["uid"] == OWNER and owner["controller"]
    assert VMPod.from_body(body).owner_uid == OWNER  # what it makes, it takes back
    assert VMPod.from_body(body).size == (4, 8192)
    spec = body["spec"]
    assert body["metadata"]["namespace"] == "impvm"
    assert body["metadata"]["labels"][VM_POD_UID_LABEL] == v.uid
    (c,) = spec["containers"]
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": "8292Mi"},
        "limits": {"memory": "8292Mi"},
    }
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert [{e["key"]: e["values"] for e in t["matchExpressions"]} for t in terms] == [
        {"pool": ["small"], "zone": ["z1"]},
        {"pool": ["large"], "zone": ["z1"]},
    ]
    assert all(t["matchFields"][0]["values"] == ["sick"] for t in terms)
    assert {t["key"] for t in spec["tolerations"]} == {"imp.dev/vm-host", "gpu"}
    assert spec["priorityClassName"] == "urgent"
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    pinned = get_vm_pod(CreatePod(v, (4, 8192), "a"), settings_, None, "impvm")["spec"]
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert pinned["nodeName"] == "a" and "affinity" not in pinned
    assert pinned["priorityClassName"] == "vms"
