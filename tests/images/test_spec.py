"""The pure parts of the image build: the lock, package drift, keys, reproducible tarballs."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impvm.images.keys import input_key, root_key
from impvm.images.lock import (
    LockError,
    WheelLock,
    dump_lock,
    load_lock,
    package_drift,
    parse_dpkg_list,
    requirements_with_hashes,
    wheel_from_file,
)
from impvm.images.options import DEFAULT_LOCK
from impvm.images.runner_release import RunnerChecksumError, verify_runner_tarball
from impvm.images.spec import IMAGES, ROOTS, image_config_args
from impvm.images.tarballs import drop_device_nodes, write_tree_tar

names = st.text("abcdefgh-+.0123", min_size=1, max_size=8)
versions = st.text("0123456789.:~+-a", min_size=1, max_size=8)


def test_committed_lock_is_valid_complete_and_canonical() -> None:
    text = DEFAULT_LOCK.read_text()
    lock = load_lock(text)
    assert dump_lock(lock) == text  # written by dump_lock: stable for review diffs
    for root in ROOTS:
        pkgs = lock.roots[root.name].packages
        assert pkgs, f"{root.name}: no package versions recorded"
        for name in lock.roots[root.name].include:
            assert name in pkgs, f"{root.name}: {name} asked for but not installed"
    wheel_names = {w.name.lower().replace("_", "-") for w in lock.wheels}
    assert {"pip", "kopf", "pydantic", "httpx", "lightkube"} <= wheel_names
    # every wheel version is the one constraints.txt pins
    pins = {}
    for line in (DEFAULT_LOCK.parents[1] / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            n, v = line.split("==")
            pins[n.lower().replace("_", "-")] = v.strip()
    for w in lock.wheels:
        n = w.name.lower().replace("_", "-")
        if n != "pip":
            assert pins.get(n) == w.version, f"{w.file} is not the version constraints.txt pins"
    assert lock.runner.version and len(lock.runner.sha256) == 64


def test_lock_errors_name_the_field() -> None:
    good = json.loads(DEFAULT_LOCK.read_text())
    bad = json.loads(json.dumps(good))
    bad["runner"]["sha256"] = "nothex"
    with pytest.raises(LockError, match=r"runner\.sha256"):
        load_lock(json.dumps(bad))
    bad = json.loads(json.dumps(good))
    bad["debian"]["mirror"] = "x"
    with pytest.raises(LockError, match=r"debian\.mirror"):
        load_lock(json.dumps(bad))
    bad = json.loads(json.dumps(good))
    del bad["roots"]["runner-base"]
    with pytest.raises(LockError, match=r"roots\.runner-base: missing"):
        load_lock(json.dumps(bad))
    with pytest.raises(LockError):
        load_lock("{not json")


@given(st.dictionaries(names, versions), st.dictionaries(names, versions))
def test_package_drift_is_empty_exactly_when_equal(a: dict[str, str], b: dict[str, str]) -> None:
    drift = package_drift(a, b)
    assert (drift == []) == (a == b)
    changed = {n for n in set(a) | set(b) if a.get(n) != b.get(n)}
    assert [d.split(":")[0] for d in drift] == sorted(changed)


def test_package_drift_lines() -> None:
    assert package_drift(
        {"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "2+deb12u1", "d": "4"}
    ) == [
        "b: locked 2, built 2+deb12u1",
        "c: locked 3, not built",
        "d: built 4, not in the lock",
    ]


def test_parse_dpkg_list() -> None:
    text = "adduser 3.134\nlibc6 2.36-9+deb12u13\n\nbroken\npython3.11 3.11.2-6+deb12u6\n"
    assert parse_dpkg_list(text) == {
        "adduser": "3.134",
        "libc6": "2.36-9+deb12u13",
        "python3.11": "3.11.2-6+deb12u6",
    }


def test_requirements_pin_every_wheel_by_hash_and_can_exclude() -> None:
    ws = [
        WheelLock(
            name="Zeta_X", version="1.0", file="Zeta_X-1.0-py3-none-any.whl", sha256="a" * 64
        ),
        WheelLock(name="pip", version="26.3", file="pip-26.3-py3-none-any.whl", sha256="b" * 64),
    ]
    assert requirements_with_hashes(ws) == (
        f"pip==26.3 --hash=sha256:{'b' * 64}\nZeta_X==1.0 --hash=sha256:{'a' * 64}\n"
    )
    assert "pip" not in requirements_with_hashes(ws, exclude=("PIP",))
    w = wheel_from_file("pydantic_core-2.50.4-cp311-cp311-manylinux_2_17_x86_64.whl", "c" * 64)
    assert (w.name, w.version) == ("pydantic_core", "2.50.4")
    with pytest.raises(LockError):
        wheel_from_file("notawheel.tar.gz", "c" * 64)


@given(st.lists(st.text(max_size=5), max_size=4), st.lists(st.text(max_size=5), max_size=4))
def test_input_key_separates_parts(a: list[str], b: list[str]) -> None:
    assert (input_key(*a) == input_key(*b)) == (a == b)


def test_root_key_follows_every_input() -> None:
    lock = load_lock(DEFAULT_LOCK.read_text())
    base = root_key(lock, "impvm-base", "hook")
    assert root_key(lock, "impvm-base", "hook") == base
    assert root_key(lock, "impvm-base", "hook2") != base
    changed = lock.model_copy(deep=True)
    changed.debian.source_date_epoch += 1
    assert root_key(changed, "impvm-base", "hook") != base
    changed = lock.model_copy(deep=True)
    pkg = next(iter(changed.roots["impvm-base"].packages))
    changed.roots["impvm-base"].packages[pkg] += "+1"
    assert root_key(changed, "impvm-base", "hook") != base
    changed = lock.model_copy(deep=True)
    changed.wheels[0].sha256 = "0" * 64
    assert root_key(changed, "impvm-base", "hook") != base
    # the runner base has no Python environment: wheels are not its input
    assert root_key(changed, "runner-base", "h") == root_key(lock, "runner-base", "h")


def test_image_configs_follow_the_contracts() -> None:
    by_name = {s.name: s for s in IMAGES}
    assert by_name["runner-base"].cmd == ("/usr/local/bin/runner",)
    assert by_name["runner-layer"].cmd == ("/usr/local/bin/runner",)
    assert by_name["impvm"].user == "10000:10000"  # the operator is not root
    assert by_name["impvm-agent"].layers[-1] == by_name["impvm"].layers[-1] == "app"
    args = image_config_args(by_name["impvm"], "2025-11-24T00:00:00Z")
    assert args[:4] == [
        "--created",
        "2025-11-24T00:00:00Z",
        "--history.created",
        "2025-11-24T00:00:00Z",
    ]
    assert ["--config.user", "10000:10000"] == args[args.index("--config.user") :][:2]


def _tree(root: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        (root / "d/e").mkdir(parents=True)
        (root / "d/e/f.txt").write_text("data")
        (root / "b.sh").write_text("#!/bin/sh\n")
        (root / "b.sh").chmod(0o700 & ~umask | 0o100)
        (root / "link").symlink_to("d/e/f.txt")
        os.link(root / "d/e/f.txt", root / "hard")
    finally:
        os.umask(old)


def test_tree_tar_is_reproducible_whatever_the_umask_and_mtimes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _tree(a, 0o022)
    _tree(b, 0o077)
    os.utime(b / "d/e/f.txt", (2_000_000_000, 2_000_000_000))
    epoch = 1_700_000_000
    ta, tb = tmp_path / "a.tar", tmp_path / "b.tar"
    size = write_tree_tar(a, ta, epoch, lambda p: (10001, 10001) if p.startswith("d") else (0, 0))
    write_tree_tar(b, tb, epoch, lambda p: (10001, 10001) if p.startswith("d") else (0, 0))
    assert size == len("data") + len("#!/bin/sh\n")  # the hard link's data once
    assert hashlib.sha256(ta.read_bytes()).digest() == hashlib.sha256(tb.read_bytes()).digest()
    with tarfile.open(ta) as t:
        members = t.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    info = {m.name: m for m in members}
    assert info["b.sh"].mode == 0o755 and info["d/e/f.txt"].mode == 0o644
    assert info["d"].mode == 0o755 and info["d"].uid == 10001 and info["b.sh"].uid == 0
    assert all(m.mtime <= epoch and m.uname == "" for m in members)
    assert info["link"].issym() and info["link"].linkname == "d/e/f.txt"
    assert info["hard"].islnk() and info["hard"].linkname == "d/e/f.txt"


def test_device_nodes_are_dropped(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.tar", tmp_path / "out.tar"
    with tarfile.open(src, "w") as t:
        for name, kind in (
            ("dev", tarfile.DIRTYPE),
            ("dev/null", tarfile.CHRTYPE),
            ("etc", tarfile.DIRTYPE),
        ):
            ti = tarfile.TarInfo(name)
            ti.type = kind
            t.addfile(ti)
        ti = tarfile.TarInfo("etc/x")
        ti.size = 3
        import io

        t.addfile(ti, io.BytesIO(b"abc"))
    assert drop_device_nodes(src, dst) == 3
    with tarfile.open(dst) as t:
        assert t.getnames() == ["dev", "etc", "etc/x"]


def test_runner_checksum_is_enforced(tmp_path: Path) -> None:
    f = tmp_path / "actions-runner-linux-x64-2.329.0.tar.gz"
    f.write_bytes(b"not the runner")
    good = hashlib.sha256(b"not the runner").hexdigest()
    verify_runner_tarball(f, good, "2.329.0")
    verify_runner_tarball(f, good.upper(), "2.329.0")
    with pytest.raises(RunnerChecksumError, match="refusing") as e:
        verify_runner_tarball(f, "0" * 64, "2.329.0")
    assert good in str(e.value) and "0" * 64 in str(e.value)
