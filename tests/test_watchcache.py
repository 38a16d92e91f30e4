"""The list+watch cache (impvm.kube.watchcache): its store on its own (events in, objects out), then the
cache against the real API server - field selectors on ImpVM.spec.nodeName, every change
delivered, a watch that expired (410 Gone) listed again, the bound on what it holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from lightkube import AsyncClient, Client
from lightkube.types import PatchType

from impvm.api.models import API_VERSION
from impvm.api.resources import ImpVMResource
from impvm.kube.watchcache import Key, Store, WatchCache, key_of


def obj(name: str, version: int, value: str = "v", ns: str = "ns") -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name, "resourceVersion": str(version)},
        "spec": {"value": value},
    }


class Parser:
    """Parses ``spec.value``; counts calls; rejects the value ``bad``."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, raw: dict[str, Any]) -> str:
        self.calls += 1
        value = str(raw["spec"]["value"])
        if value == "bad":
            raise ValueError("bad object")
        return value


# ------------------------------------------------------------------------------ the store


def test_replace_reports_what_changed_and_parses_once_per_version() -> None:
    parse = Parser()
    s: Store[str] = Store(parse, max_objects=10, name="t")
    assert s.replace([obj("a", 1), obj("b", 1)]) == {("ns", "a"), ("ns", "b")}
    assert parse.calls == 2
    changed = s.replace([obj("a", 1), obj("b", 2, "w"), obj("c", 1)])
    assert changed == {("ns", "b"), ("ns", "c")}
    assert parse.calls == 4  # a was not parsed again
    assert s.replace([obj("c", 1)]) == {("ns", "a"), ("ns", "b")}  # removed without an event
    assert s.keys() == [("ns", "c")] and s.values() == ["v"] and len(s) == 1


def test_events_add_change_and_delete() -> None:
    s: Store[str] = Store(Parser(), max_objects=10)
    assert s.apply("ADDED", obj("a", 1))
    assert not s.apply("MODIFIED", obj("a", 1))  # same version: nothing new
    assert s.apply("MODIFIED", obj("a", 2, "w")) and s.get(("ns", "a")) == "w"
    assert s.version(("ns", "a")) == "2"
    assert s.apply("DELETED", obj("a", 3)) and s.get(("ns", "a")) is None
    assert not s.apply("DELETED", obj("a", 3))
    assert key_of({"metadata": {"name": "cls"}}) == ("", "cls")  # cluster-scoped


def test_a_deleted_object_marked_until_the_watch_reports_it() -> None:
    """A deletion answers with no object: the stored one is marked; the watch's next version
    (or its DELETED) replaces the mark, an older or equal version does not."""
    s: Store[str] = Store(Parser(), max_objects=10)
    s.apply("ADDED", obj("a", 1))
    assert s.mark(("ns", "a"), lambda v: v + ":deleting")
    assert not s.mark(("ns", "b"), lambda v: v)
    assert not s.apply("MODIFIED", obj("a", 1))  # the version marked: still marked
    assert s.get(("ns", "a")) == "v:deleting"
    assert s.apply("MODIFIED", obj("a", 2, "w")) and s.get(("ns", "a")) == "w"
    assert s.apply("DELETED", obj("a", 2)) and s.get(("ns", "a")) is None


def test_a_write_answered_after_its_objects_deletion_does_not_bring_it_back() -> None:
    """The watch delivered the deletion before the write's answer came: the answer (same uid)
    is ignored; a new object of the same name (another uid) is stored."""
    s: Store[str] = Store(Parser(), max_objects=10)
    first = obj("a", 1)
    first["metadata"]["uid"] = "u1"
    s.apply("ADDED", first)
    gone = obj("a", 3)
    gone["metadata"]["uid"] = "u1"
    s.apply("DELETED", gone)
    late = obj("a", 2, "late")
    late["metadata"]["uid"] = "u1"
    s.written(late)
    assert s.get(("ns", "a")) is None
    again = obj("a", 4, "new")
    again["metadata"]["uid"] = "u2"
    s.written(again)
    assert s.get(("ns", "a")) == "new"


def test_a_rejected_object_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    s: Store[str] = Store(Parser(), max_objects=10, name="t")
    with caplog.at_level(logging.WARNING, "impvm.kube.watchcache"):
        s.replace([obj("a", 1), obj("b", 1, "bad")])
    assert s.keys() == [("ns", "a")]
    assert "ns/b" in caplog.text and "ValueError" in caplog.text
    s.apply("ADDED", obj("b", 2, "bad"))
    assert s.apply("MODIFIED", obj("a", 2, "bad"))  # a valid object turned bad: gone
    assert s.keys() == []


def test_own_write_is_seen_at_once_and_older_events_do_not_undo_it() -> None:
    s: Store[str] = Store(Parser(), max_objects=10)
    s.apply("ADDED", obj("a", 1, "old"))
    s.written(obj("a", 5, "mine"))
    assert s.get(("ns", "a")) == "mine"
    # events from before the write arrive late: ignored
    assert not s.apply("MODIFIED", obj("a", 3, "someone-else-earlier"))
    assert s.get(("ns", "a")) == "mine"
    assert not s.apply("MODIFIED", obj("a", 5, "mine"))  # the write itself: caught up
    assert s.apply("MODIFIED", obj("a", 6, "later")) and s.get(("ns", "a")) == "later"
    # a write that changed nothing (same version) leaves no pending mark
    s.written(obj("a", 6, "later"))
    assert s.apply("MODIFIED", obj("a", 7, "next"))
    # a list is newer than any pending write
    s.written(obj("a", 9, "mine-again"))
    s.replace([obj("a", 8, "listed")])
    assert s.get(("ns", "a")) == "listed"


def test_own_write_answered_after_the_watch_delivered_it_hides_nothing_newer() -> None:
    s: Store[str] = Store(Parser(), max_objects=10)
    s.apply("ADDED", obj("a", 1, "old"))
    # the watch delivers the write and someone else's later change before the write's answer
    assert s.apply("MODIFIED", obj("a", 5, "mine"))
    assert s.apply("MODIFIED", obj("a", 6, "operator"))
    s.written(obj("a", 5, "mine"))
    assert s.get(("ns", "a")) == "operator"
    assert s.apply("MODIFIED", obj("a", 7, "next")) and s.get(("ns", "a")) == "next"
    # the same after a list that held the write
    s.replace([obj("a", 8, "listed")])
    s.written(obj("a", 8, "listed"))
    assert s.apply("MODIFIED", obj("a", 9, "after")) and s.get(("ns", "a")) == "after"


def test_bounded() -> None:
    s: Store[str] = Store(Parser(), max_objects=2)
    s.replace([obj("a", 1), obj("b", 1), obj("c", 1)])
    assert len(s) == 2 and s.dropped == 1 and not s.has_room_for_dropped
    assert not s.apply("ADDED", obj("d", 2)) and s.dropped == 2
    s.apply("DELETED", obj("a", 3))
    assert s.has_room_for_dropped  # a new list would pick up what was left out
    s.written(obj("x", 4))
    s.written(obj("y", 4))
    assert len(s) == 3  # own writes are kept, full or not
    s.replace([obj("c", 1)])
    assert s.dropped == 0 and not s.has_room_for_dropped


def test_one_namespace_never_pushes_another_out() -> None:
    """Objects anyone may create in their own namespace (a Secret or ImpVM labelled for a
    pool) fill that namespace's share only."""
    s: Store[str] = Store(Parser(), max_objects=100, max_per_namespace=3)

    def in_ns(ns: str, name: str, rv: int) -> dict[str, Any]:
        raw = obj(name, rv)
        raw["metadata"]["namespace"] = ns
        return raw

    s.replace([in_ns("flood", f"f{i}", 1) for i in range(10)] + [in_ns("team", "t0", 1)])
    assert sorted(k for k in s.keys() if k[0] == "team") == [("team", "t0")]
    assert sum(1 for k in s.keys() if k[0] == "flood") == 3 and s.dropped == 7
    assert not s.apply("ADDED", in_ns("flood", "f99", 2))
    assert s.apply("ADDED", in_ns("team", "t1", 2)) and s.get(("team", "t1")) == "v"
    assert s.room_for_dropped("team") is None
    s.apply("DELETED", in_ns("flood", "f0", 3))
    assert s.room_for_dropped("flood") == "namespace"


# ------------------------------------------------------------------------------ the API server


@contextlib.asynccontextmanager
async def running(
    cache: WatchCache[Any], resource_version: str | None = None
) -> AsyncIterator[None]:
    """The cache's ``run`` as a task for the block."""
    task = asyncio.create_task(cache.run(resource_version))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def vm_body(name: str, namespace: str, node: str | None = None) -> Any:
    spec: dict[str, Any] = {"classRef": {"name": "c"}, "image": "r/i@sha256:" + "0" * 64}
    if node is not None:
        spec["nodeName"] = node
    return ImpVMResource.from_dict(
        {
            "apiVersion": API_VERSION,
            "kind": "ImpVM",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
    )


def node_of(raw: dict[str, Any]) -> str:
    return f"{raw['metadata']['name']}@{(raw.get('spec') or {}).get('nodeName') or '-'}"


async def until(what: str, check: Callable[[], bool], seconds: float = 20) -> None:
    for _ in range(int(seconds * 20)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


def names(cache: WatchCache[str], namespace: str) -> set[str]:
    return {
        v.split("@")[0] for k, v in zip(cache.store.keys(), cache.values()) if k[0] == namespace
    }


@pytest.mark.controlplane
async def test_watches_one_node_and_the_unbound(
    kube: Client, akube: AsyncClient, namespace: str
) -> None:
    kube.create(vm_body("free", namespace))
    kube.create(vm_body("mine", namespace, "node-1"))
    kube.create(vm_body("theirs", namespace, "node-2"))
    changes: list[Key] = []
    mine = WatchCache(
        akube, ImpVMResource, node_of, fields={"spec.nodeName": "node-1"}, on_change=changes.append
    )
    unbound = WatchCache(akube, ImpVMResource, node_of, fields={"spec.nodeName": ""})
    async with running(mine), running(unbound):
        await asyncio.wait_for(asyncio.gather(mine.synced.wait(), unbound.synced.wait()), 20)
        assert names(mine, namespace) == {"mine"} and names(unbound, namespace) == {"free"}
        assert (namespace, "mine") in changes
        # binding moves a VM from one selection to the other
        await akube.patch(
            ImpVMResource,
            "free",
            {"spec": {"nodeName": "node-1"}},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )
        await until("free bound", lambda: names(mine, namespace) == {"free", "mine"})
        await until("free left the unbound", lambda: names(unbound, namespace) == set())
        assert mine.get((namespace, "free")) == "free@node-1"
        kube.create(vm_body("late", namespace))
        await until("late seen", lambda: names(unbound, namespace) == {"late"})
        kube.delete(ImpVMResource, "mine", namespace=namespace)
        await until("mine gone", lambda: names(mine, namespace) == {"free"})
        assert changes.count((namespace, "mine")) >= 2  # added, deleted
        assert mine.lists == 1 and unbound.lists == 1  # no list after the first


@pytest.mark.controlplane
async def test_expired_watch_lists_again(kube: Client, akube: AsyncClient, namespace: str) -> None:
    """A watch from a version the server no longer has (410 Gone) lists again, and what was
    deleted in between leaves the cache although no DELETED event ever came."""
    kube.create(vm_body("a", namespace, "node-x"))
    cache = WatchCache(akube, ImpVMResource, node_of, fields={"spec.nodeName": "node-x"})
    await cache.relist()
    assert names(cache, namespace) == {"a"}
    kube.delete(ImpVMResource, "a", namespace=namespace)
    kube.create(vm_body("b", namespace, "node-x"))
    async with running(cache, resource_version="1"):  # long compacted away
        await until("relisted", lambda: cache.lists == 2 and names(cache, namespace) == {"b"})


@pytest.mark.controlplane
async def test_a_full_cache_lists_again_once_there_is_room(
    kube: Client, akube: AsyncClient, namespace: str
) -> None:
    for n in ("a", "b", "c"):
        kube.create(vm_body(n, namespace, "node-full"))
    cache = WatchCache(
        akube, ImpVMResource, node_of, fields={"spec.nodeName": "node-full"}, max_objects=2
    )
    async with running(cache):
        await until("listed", lambda: cache.lists == 1)
        assert len(names(cache, namespace)) == 2 and cache.store.dropped == 1
        held = sorted(names(cache, namespace))
        kube.delete(ImpVMResource, held[0], namespace=namespace)
        await until(
            "the left-out VM picked up",
            lambda: names(cache, namespace) == {"a", "b", "c"} - {held[0]},
        )
        assert cache.lists == 2 and cache.store.dropped == 0


@pytest.mark.controlplane
async def test_own_write_is_in_the_cache_before_the_watch_brings_it(
    kube: Client, akube: AsyncClient, namespace: str
) -> None:
    kube.create(vm_body("w", namespace, "node-w"))
    changes: list[Key] = []

    def phase(raw: dict[str, Any]) -> str:
        return str((raw.get("status") or {}).get("phase"))

    cache = WatchCache(
        akube, ImpVMResource, phase, fields={"spec.nodeName": "node-w"}, on_change=changes.append
    )
    listed = await cache.relist()
    changes.clear()

    async def set_phase(value: str) -> dict[str, Any]:
        got = await akube.patch(
            ImpVMResource.Status,
            "w",
            {"status": {"phase": value}},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )
        return dict(got.to_dict())

    cache.written(await set_phase("Scheduled"))
    mine = await set_phase("Starting")
    cache.written(mine)
    assert cache.get((namespace, "w")) == "Starting"  # no watch runs yet
    async with running(cache, resource_version=listed):
        # the watch replays Scheduled (older than the write) and Starting (the write itself)
        await until(
            "watch caught up", lambda: cache._version == mine["metadata"]["resourceVersion"]
        )
        assert cache.get((namespace, "w")) == "Starting" and changes == []
        await set_phase("Running")  # someone else's change is delivered as usual
        await until("Running seen", lambda: cache.get((namespace, "w")) == "Running")
        assert changes == [(namespace, "w")]
