"""The runner layer takes the GitHub runner release (version + published sha256) as input: a
tarball whose checksum differs is refused, downloaded (from a loopback HTTP server standing in for
GitHub's release downloads) or given as a file; the right one becomes
``/home/runner/actions-runner`` owned by the runner user, next to the wrapper."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from impvm.images.build import build_images
from impvm.images.options import BuildOptions, RunnerSource
from impvm.images.runner_inputs import runner_wrapper_script
from impvm.images.runner_release import RunnerChecksumError

from .conftest import lock_copy

VERSION = "2.999.0"


def _fake_release(path: Path) -> str:
    """A tarball laid out like actions-runner-linux-x64-*.tar.gz; returns its sha256."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data, mode in (
            ("./run.sh", b"#!/bin/bash\necho runner\n", 0o755),
            ("./config.sh", b"#!/bin/bash\n", 0o755),
            ("./bin/Runner.Listener", b"\x7fELF...", 0o755),
            ("./bin/Runner.Listener.deps.json", b"{}", 0o644),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 1_600_000_000
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def release_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(URL template with {version}, sha256) of the fake release served on loopback."""
    root = tmp_path / "releases" / f"v{VERSION}"
    root.mkdir(parents=True)
    sha = _fake_release(root / f"actions-runner-linux-x64-{VERSION}.tar.gz")
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(_Quiet, directory=str(tmp_path / "releases"))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        yield (
            f"http://127.0.0.1:{port}/v{{version}}/actions-runner-linux-x64-{{version}}.tar.gz",
            sha,
        )
    finally:
        server.shutdown()
        server.server_close()


def _layer_members(layout: Path, tag: str) -> dict[str, tuple[tarfile.TarInfo, bytes]]:
    index = json.loads((layout / "index.json").read_text())
    desc = next(
        m
        for m in index["manifests"]
        if m["annotations"]["org.opencontainers.image.ref.name"] == tag
    )
    blob = lambda d: (layout / "blobs" / "sha256" / d.split(":")[1]).read_bytes()  # noqa: E731
    manifest = json.loads(blob(desc["digest"]))
    [layer] = manifest["layers"]
    out = {}
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(layer["digest"])))) as tar:
        for m in tar:
            data = tar.extractfile(m).read() if m.isreg() else b""  # type: ignore[union-attr]
            out[m.name] = (m, data)
    return out


async def test_a_runner_tarball_with_another_checksum_is_refused(
    tmp_path: Path, release_server: tuple[str, str]
) -> None:
    url, good = release_server
    cache = tmp_path / "cache"
    opts = BuildOptions(
        lock_path=lock_copy(),
        cache_dir=cache,
        images=("runner-layer",),
        runner=RunnerSource(version=VERSION, sha256="0" * 64, url=url),
        log=lambda _line: None,
    )
    with pytest.raises(RunnerChecksumError, match=f"sha256 is {good}.*refusing"):
        await build_images(opts)
    assert not list((cache / "downloads").iterdir())  # nothing kept
    index = json.loads((cache / "oci" / "index.json").read_text())
    assert not index.get("manifests")  # nothing built

    # the same through the command, with a file: one line, exit 2
    tarball = tmp_path / "releases" / f"v{VERSION}" / f"actions-runner-linux-x64-{VERSION}.tar.gz"
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "impvm.cli",
            "images",
            "build",
            "runner-layer",
            "--lock",
            str(lock_copy()),
            "--cache-dir",
            str(cache),
            "--runner-version",
            VERSION,
            "--runner-sha256",
            "f" * 64,
            "--runner-tarball",
            str(tarball),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "refusing to build the runner layer" in proc.stderr
    assert proc.stdout == ""

    # a version the lock does not know needs its checksum
    opts.runner = RunnerSource(version=VERSION, url=url)
    with pytest.raises(Exception, match="--runner-sha256"):
        await build_images(opts)

    # the published checksum: built
    opts.runner = RunnerSource(version=VERSION, sha256=good.upper(), url=url)
    [image] = await build_images(opts)
    assert image.name == "runner-layer" and image.digest.startswith("sha256:")
    members = _layer_members(cache / "oci", image.tag)
    run_sh, data = members["home/runner/actions-runner/run.sh"]
    assert data == b"#!/bin/bash\necho runner\n" and run_sh.mode == 0o755
    assert (run_sh.uid, run_sh.gid) == (10001, 10001)
    assert members["home/runner/actions-runner/bin/Runner.Listener"][0].mode == 0o755
    assert members["home/runner"][0].uid == 10001
    wrapper, data = members["usr/local/bin/runner"]
    assert data == runner_wrapper_script() and (wrapper.uid, wrapper.mode) == (0, 0o755)
    assert all(m.mtime <= 1_763_942_400 for m, _ in members.values())
    assert [p.name for p in (cache / "downloads").iterdir()] == [
        f"{good[:16]}-actions-runner-linux-x64-{VERSION}.tar.gz"
    ]
