"""Hostile images against the image store and the process runtime: real umoci-built images in
the test registry whose layers try to write through symlinks onto the host, leave the root with
``..``, hard-link host paths, bring device nodes, or inflate beyond the cache's cap. The host
stays untouched, and what is refused is refused with a reason naming the entry."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from lightkube import AsyncClient, Client

from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.agent.runtime import ImageError, Secret
from impvm.api.resources import ImpVMClassResource
from impvm.devstack.registry import LocalRegistry
from tests.agent import hostile
from tests.agent.hostile import Entry, device, directory, file, hardlink, symlink, zeros
from tests.agent.test_agent import Env, until
from tests.runtime_fixtures import Images, vm_request, wait_for

RUNNER = "#!/bin/sh\necho layer-runner-ran\nexit 7\n"


@dataclass(frozen=True)
class Host:
    """What an attack aims at on the host: ``victim`` (a file), ``dir`` (an empty directory)."""

    root: Path
    victim: Path
    dir: Path

    def untouched(self) -> None:
        assert self.victim.read_text() == "original\n"
        assert os.stat(self.victim).st_nlink == 1
        assert list(self.dir.iterdir()) == []


@pytest.fixture
def host(tmp_path: Path) -> Host:
    root = tmp_path / "host"
    (root / "dir").mkdir(parents=True)
    (root / "victim").write_text("original\n")
    return Host(root, root / "victim", root / "dir")


class Pusher:
    """Builds and pushes hostile images (one repository per image) to the test registry."""

    def __init__(self, registry: LocalRegistry, work: Path) -> None:
        self.registry = registry
        self.work = work
        self.n = 0

    async def image(self, *layers: list[Entry]) -> str:
        self.n += 1
        return await hostile.push_image(
            self.work / f"img{self.n}", self.registry.address, f"hostile/i{self.n}", "t", layers
        )

    async def pair(self, base: list[Entry], layer: list[Entry]) -> tuple[str, str]:
        return await self.image(base), await self.image(layer)


@pytest_asyncio.fixture
async def push(registry: LocalRegistry, tmp_path: Path) -> AsyncIterator[Pusher]:
    yield Pusher(registry, tmp_path / "build")


def _store(tmp_path: Path, registry: LocalRegistry, max_bytes: int = 1 << 30) -> ImageStore:
    return ImageStore(tmp_path / "cache", max_bytes, {registry.address})


def _nothing_left(store: ImageStore) -> None:
    assert list((store.cache_dir / "images").iterdir()) == []
    assert list((store.cache_dir / "tmp").iterdir()) == []


def _runner_layer(body: str = RUNNER) -> list[Entry]:
    dirs = [directory(d) for d in ("usr", "usr/local", "usr/local/bin")]
    return [*dirs, file("usr/local/bin/runner", body, 0o755)]


def _base_without(*prefixes: str) -> list[Entry]:
    return [e for e in hostile.busybox_base() if not e.name.startswith(prefixes)]


async def test_a_base_symlink_to_a_host_file_is_replaced_not_written_through(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, host: Host
) -> None:
    """The reported attack: the base image has ``usr/local/bin/runner -> <host file>``, the
    runner layer a regular file there. The layer's file replaces the symlink inside the root
    (OCI layer semantics); the host file keeps its content (``cp -a`` wrote through it)."""
    base = [*hostile.busybox_base(), symlink("usr/local/bin/runner", str(host.victim))]
    image, layer = await push.pair(base, _runner_layer())
    prepared = await _store(tmp_path, registry).prepare(image, layer)
    host.untouched()
    runner = prepared.rootfs / "usr/local/bin/runner"
    assert not runner.is_symlink() and runner.read_text() == RUNNER


async def test_a_base_directory_symlink_to_a_host_path_resolves_inside_the_root(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, host: Host
) -> None:
    """``usr/local/bin -> <host dir>`` (absolute) in the base, the runner in the layer (no
    directory entries of its own): the file lands below the root, where the symlink leads
    inside it, as a guest would resolve it; the host directory stays empty."""
    base = [*_base_without("usr/local/bin"), symlink("usr/local/bin", str(host.dir))]
    image, layer = await push.pair(base, [file("usr/local/bin/runner", RUNNER, 0o755)])
    prepared = await _store(tmp_path, registry).prepare(image, layer)
    host.untouched()
    inside = prepared.rootfs / str(host.dir).lstrip("/") / "runner"
    assert inside.read_text() == RUNNER


@pytest.mark.parametrize(
    ("case", "entry", "rule"),
    [
        (
            "a relative symlink climbing out of the root",
            "usr/local/bin",
            "is a symlink to '../../../../../../../../../../..",
        ),
        ("a path with ..", "../../../../../../../../../..", "its path leaves the image root"),
        ("a hard link climbing out of the root", "usr/local/bin/runner", "is a hard link to"),
        ("a block device", "usr/local/bin/disk", "is a device node"),
        ("a character device", "dev-mem", "is a device node"),
    ],
)
async def test_an_entry_leaving_the_root_or_a_device_is_refused_by_name(
    tmp_path: Path,
    registry: LocalRegistry,
    push: Pusher,
    host: Host,
    case: str,
    entry: str,
    rule: str,
) -> None:
    climb = "../" * 12 + str(host.root).lstrip("/")
    base, layer = hostile.busybox_base(), _runner_layer()
    if case.startswith("a relative symlink"):
        base = [*_base_without("usr/local/bin"), symlink("usr/local/bin", f"{climb}/dir")]
        layer = [file("usr/local/bin/runner", RUNNER, 0o755)]
    elif case == "a path with ..":
        layer = [*layer, file(f"{climb}/dir/planted", "x")]
        entry = f"{climb}/dir/planted"
    elif case.startswith("a hard link"):
        layer = [*layer[:-1], hardlink("usr/local/bin/runner", f"{climb}/victim")]
    elif case == "a block device":
        layer = [*layer, device(entry, "blk", 7, 0)]
    else:
        layer = [*layer, device(entry, "chr", 1, 1)]
    image, runner_layer = await push.pair(base, layer)
    store = _store(tmp_path, registry)
    with pytest.raises(ImageError) as err:
        await store.prepare(image, runner_layer)
    message = str(err.value)
    assert f"entry {entry!r} is refused" in message and rule in message, message
    assert getattr(err.value, "reason", None) == "ImageRefused"
    host.untouched()
    _nothing_left(store)


async def test_a_hard_link_to_an_absolute_host_path_stays_inside_the_root(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, host: Host
) -> None:
    """A hard link's absolute target is taken from the image's root (Docker's rule): linking
    the host file is impossible, the image path it names does not exist, umoci says so."""
    layer = [*_runner_layer()[:-1], hardlink("usr/local/bin/runner", str(host.victim))]
    image, runner_layer = await push.pair(hostile.busybox_base(), layer)
    store = _store(tmp_path, registry)
    with pytest.raises(ImageError, match="usr/local/bin/runner: link: no such file"):
        await store.prepare(image, runner_layer)
    host.untouched()
    _nothing_left(store)


@contextlib.contextmanager
def _tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` at ``path`` (root only): a write beyond it fails at once."""
    path.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
async def test_a_decompression_bomb_stops_at_the_cap_having_written_nothing(
    tmp_path: Path, registry: LocalRegistry, push: Pusher
) -> None:
    """A runner layer of about 1 MB compressed that inflates to 600 MiB, a cap of 64 MiB, the
    cache on a 96 MiB tmpfs: the store refuses it naming the cap. Had it unpacked first and
    measured after, the tmpfs would have filled (a disk-full error instead, or the entry kept)."""
    layer = [*_runner_layer(), zeros("home/runner/bomb", 600 << 20)]
    image, runner_layer = await push.pair(hostile.busybox_base(), layer)
    with _tmpfs(tmp_path / "small", 96) as disk:
        store = ImageStore(disk / "cache", 64 << 20, {registry.address})
        with pytest.raises(ImageError) as err:
            await store.prepare(image, runner_layer)
        assert getattr(err.value, "reason", None) == "ImageTooLarge", err.value
        assert "more than the image cache's size cap of 64 MiB" in str(err.value)
        assert runner_layer in str(err.value)
        _nothing_left(store)
        assert os.statvfs(disk).f_bfree * os.statvfs(disk).f_frsize > 90 << 20


async def test_an_image_declaring_more_than_the_cap_is_refused_before_its_pull(
    tmp_path: Path, registry: LocalRegistry, push: Pusher
) -> None:
    """A layer of 3 MiB of incompressible data, a cap of 2 MiB: the manifest's declared sizes
    are over the cap, so nothing is pulled (no layout is made) and the reason says so."""
    noise = os.urandom(3 << 20)
    image = await push.image([*hostile.busybox_base(), file("noise", noise)])
    store = _store(tmp_path, registry, max_bytes=2 << 20)
    with pytest.raises(ImageError, match="refused before it was pulled") as err:
        await store.prepare(image)
    assert getattr(err.value, "reason", None) == "ImageTooLarge"
    _nothing_left(store)


async def test_the_process_runtime_never_makes_mount_points_through_image_symlinks(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, host: Host
) -> None:
    """bwrap creates its mount points (``/home/runner/_work``, ``/tmp``) by walking paths in
    the new root while the host's root is still at ``/oldroot``: a base image whose ``home``
    is a symlink to ``/oldroot/<host dir>`` made it create ``runner/_work`` on the host. Now
    the runner runs (its work directory on bwrap's own tmpfs) and the host directory stays
    empty."""
    base = [*_base_without("home"), symlink("home", f"/oldroot{host.dir}")]
    image, layer = await push.pair(base, _runner_layer())
    rt = ProcessRuntime(_store(tmp_path, registry))
    req = vm_request(tmp_path, "mounts", image, layer, memory_mib=64)
    await rt.start(req, Secret("jit-mount-points"))
    state = await wait_for(rt, req, None, 60)
    await rt.cleanup(req)
    assert "layer-runner-ran" in state.log_tail and state.exit_code == 7, state
    host.untouched()


@pytest.mark.controlplane
async def test_a_vm_of_a_hostile_image_fails_saying_why_and_the_host_is_untouched(
    kube: Client,
    akube: AsyncClient,
    namespace: str,
    tmp_path: Path,
    images: Images,
    registry: LocalRegistry,
    push: Pusher,
    host: Host,
) -> None:
    """Through a real agent and API server: a VM whose runner layer brings a device node is
    Failed with exitReason ImageRefused and a message naming the entry; a VM whose base image
    points its runner at a host file runs the layer's runner (its exit code 7 reported) and
    the host file keeps its content."""
    env = Env(kube, akube, namespace, tmp_path, images)
    env.create_class()
    try:
        dev_image, dev_layer = await push.pair(
            hostile.busybox_base(), [*_runner_layer(), device("usr/local/bin/disk", "blk", 7, 0)]
        )
        base = [*hostile.busybox_base(), symlink("usr/local/bin/runner", str(host.victim))]
        link_image, link_layer = await push.pair(base, _runner_layer())
        async with env.agent():
            env.create_vm("device", dev_layer, image=dev_image)
            env.create_vm("through", link_layer, image=link_image)

            async def both_done() -> bool:
                got = await env.vms()
                return len(got) == 2 and all(
                    (v.get("status") or {}).get("phase") == "Failed"
                    and not v["metadata"].get("finalizers")
                    for v in got.values()
                )

            await until("both VMs ended", both_done, 120)
            vms = await env.vms()
        refused = vms["device"]["status"]
        assert refused["exitReason"] == "ImageRefused", refused
        assert "entry 'usr/local/bin/disk' is refused: it is a device node" in refused["message"]
        ran = vms["through"]["status"]
        assert ran["exitReason"] == "Error" and ran["exitCode"] == 7, ran
        assert "layer-runner-ran" in ran["consoleTail"]
        host.untouched()
    finally:
        with contextlib.suppress(Exception):
            kube.delete(ImpVMClassResource, env.cls)
