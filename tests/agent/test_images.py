"""ImageStore against a real registry, skopeo and umoci."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from impvm.agent.images import ImageStore, parse_reference
from impvm.agent.runtime import ImageError
from impvm.images.runner_inputs import runner_wrapper_script
from tests.runtime_fixtures import PROBE_RUN_SH, Images


def _writable(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p) and os.lstat(p).st_mode & 0o222:
                found.append(p)
    return found


def _store(tmp_path: Path, images: Images, max_bytes: int = 1 << 30) -> ImageStore:
    return ImageStore(tmp_path / "cache", max_bytes, {images.registry})


async def test_prepare_by_digest_layers_runner_on_base(tmp_path: Path, images: Images) -> None:
    store = _store(tmp_path, images)
    prepared = await store.prepare(images.base, images.probe)
    root = prepared.rootfs
    assert (root / "bin/busybox").is_file()
    assert os.readlink(root / "bin/sh") == "busybox"
    assert "runner:x:10001:10001:" in (root / "etc/passwd").read_text()
    assert (root / "usr/local/bin/runner").read_bytes() == runner_wrapper_script()
    assert (root / "home/runner/actions-runner/run.sh").read_text() == PROBE_RUN_SH
    assert os.access(root / "home/runner/actions-runner/run.sh", os.X_OK)
    assert prepared.image_digest == parse_reference(images.base).digest
    assert prepared.layer_digest == parse_reference(images.probe).digest
    # Read-only on the host: no write bit anywhere in the rootfs.
    assert _writable(root) == []
    # The layout/temp dirs of the build are gone.
    assert list((tmp_path / "cache/tmp").iterdir()) == []


async def test_tag_only_reference_is_refused(tmp_path: Path, images: Images) -> None:
    store = _store(tmp_path, images)
    tagged = f"{images.registry}/imp/runner-base:test"
    with pytest.raises(ImageError, match="not pinned by digest") as err:
        await store.prepare(tagged, None)
    assert tagged in str(err.value)
    with pytest.raises(ImageError, match="not pinned by digest"):
        await store.prepare(images.base, f"{images.registry}/imp/runner-layer:probe")
    assert store.builds == 0
    # Explicitly allowed: the tag is resolved to the same digest the pinned reference names.
    prepared = await store.prepare(tagged, None, allow_unpinned=True)
    assert prepared.image_digest == parse_reference(images.base).digest


async def test_wrong_digest_fails_clearly(tmp_path: Path, images: Images) -> None:
    store = _store(tmp_path, images)
    name = parse_reference(images.base).name
    missing = f"{name}@sha256:{'0' * 64}"
    with pytest.raises(ImageError) as err:
        await store.prepare(missing, None)
    assert missing in str(err.value)
    # A real digest, but of another repository's manifest.
    other = f"{name}@{parse_reference(images.probe).digest}"
    with pytest.raises(ImageError, match="runner-base"):
        await store.prepare(other, None)
    with pytest.raises(ImageError, match="invalid digest"):
        await store.prepare(f"{name}@sha256:1234", None)
    assert store.builds == 0
    assert list((tmp_path / "cache/images").iterdir()) == []


async def test_concurrent_prepare_of_same_pair_unpacks_once(tmp_path: Path, images: Images) -> None:
    store = _store(tmp_path, images)
    results = await asyncio.gather(*(store.prepare(images.base, images.probe) for _ in range(3)))
    assert store.builds == 1
    assert len({r.rootfs for r in results}) == 1
    assert len(list((tmp_path / "cache/images").iterdir())) == 1
    # A second store on the same dir (another process) finds the published entry.
    other = _store(tmp_path, images)
    again = await other.prepare(images.base, images.probe)
    assert other.builds == 0 and again.rootfs == results[0].rootfs


async def test_lru_eviction_respects_size_cap(tmp_path: Path, images: Images) -> None:
    store = _store(tmp_path, images)
    a = await store.prepare(images.base, images.probe)
    store.max_bytes = int(a.size_bytes * 2.5)  # room for two entries of this size
    b = await store.prepare(images.base, images.sleep)
    assert {e.key for e in store.entries()} == {a.key, b.key}
    await store.prepare(images.base, images.probe)  # hit: a becomes most recently used
    assert store.builds == 2
    c = await store.prepare(images.base, None)  # over the cap: b is least recently used
    assert {e.key for e in store.entries()} == {a.key, c.key}
    assert not b.rootfs.exists()
    assert sum(e.size_bytes for e in store.entries()) <= store.max_bytes
    # A retained entry (a running VM uses it) is not evicted, even when least recently used.
    store.retain(a.key)
    b2 = await store.prepare(images.base, images.sleep)  # a is LRU but retained: c goes
    assert {e.key for e in store.entries()} == {a.key, b2.key}
    store.release(a.key)
    store.max_bytes = int(a.size_bytes * 1.5)
    assert await store.evict() == [a.key]
    assert not a.rootfs.exists() and b2.rootfs.exists()


def test_parse_reference() -> None:
    d = "sha256:" + "a" * 64
    r = parse_reference(f"127.0.0.1:5000/imp/x:1.0@{d}")
    assert (r.name, r.tag, r.digest, r.registry) == (
        "127.0.0.1:5000/imp/x",
        "1.0",
        d,
        "127.0.0.1:5000",
    )
    r = parse_reference("debian")
    assert (r.name, r.tag, r.digest, r.registry) == ("debian", "latest", None, "docker.io")
    with pytest.raises(ValueError, match="loopback"):
        ImageStore(Path("/nonexistent"), 1, {"registry.example.com:5000"})
