"""Build the images of :mod:`impvm.images.spec` into an OCI layout, cached by their inputs.

Tools (Debian packages): ``mmdebstrap`` makes each Debian root (``--variant=minbase``, no
recommends, no documentation, man pages or locales, apt lists and caches removed, every timestamp
clamped to the lock's ``SOURCE_DATE_EPOCH``: bit-identical tarballs for the same package set);
``umoci`` adds layers verbatim (``raw add-layer``) and writes the image config with fixed
timestamps; ``skopeo`` copies images out (another OCI layout, a registry). Python wheels come from
PyPI through ``pip download --require-hashes`` (the lock's sha256 of each file); the impvm package
is built from the source tree with ``pip wheel``. Layers that are not a Debian root (the impvm
package, the runner layer) are tarballs written here with sorted entries, fixed owners, modes
normalised to 0755/0644 and clamped mtimes.

Cache (``~/.cache/impvm/images`` by default): one OCI layout ``oci/`` whose tags are
``<image>-<key>`` (``key``: :func:`impvm.images.spec.input_key` over everything that goes into the
image), plus ``debs/<root>/`` (the .deb files of each root, so a rebuild does not download them
again), ``wheels/`` and ``downloads/`` (runner tarballs, kept only once their sha256 matched).
A build whose key is already tagged does nothing; older tags of the same image are removed and
their blobs garbage-collected. Builds on one machine are serialised by a lock file.

A Debian root whose installed packages differ from the lock fails with the list of differences
(the archive moved: the inputs changed) unless ``update_lock`` is set, which records the new
versions (and wheels) in the lock file instead.

Requires root (mmdebstrap's ``root`` mode uses ``chroot``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from impvm.agent.layers import Budget, scan_layer
from impvm.agent.runtime import ImageError
from impvm.agent.tools import run_tool
from impvm.images.runner_inputs import runner_wrapper_script, standin_run_sh
from impvm.images.spec import (
    COSIGN_PATH,
    IMAGES,
    MMDEBSTRAP_OPTIONS,
    PYTHON_SITE,
    RUNNER_HOME,
    RUNNER_UID,
    RUNNER_WRAPPER,
    VENV,
    ImageSpec,
    Lock,
    LockError,
    RootLock,
    RunnerRelease,
    WheelLock,
    dump_lock,
    image_config_args,
    image_spec,
    input_key,
    load_lock,
    package_drift,
    parse_constraints,
    parse_dpkg_list,
    requirements_with_hashes,
    root_key,
    root_spec,
    wheel_from_file,
    wheels_follow_constraints,
)
from impvm.signing.cosign import SigningError, cosign_binary

PROJECT_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_LOCK = PROJECT_ROOT / "images" / "lock.json"
DEFAULT_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "impvm" / "images"
)
#: pip's own wheel (run from the wheel file inside the Debian root to install the others)
_PIP = "pip"
_CHUNK = 1 << 20
#: The most a runner release may unpack to, in bytes (2.3xx releases: about 500 MB): a
#: tarball that inflates beyond is refused before anything of it is written
RUNNER_MAX_BYTES = 2 << 30


class ImageBuildError(Exception):
    """A build step failed; the message names the step (and carries the tool's error output)."""


class RunnerChecksumError(ImageBuildError):
    """The runner tarball's sha256 is not the one published for the release: refused."""


@dataclass(frozen=True)
class RunnerSource:
    """Where ``/home/runner/actions-runner`` of the runner layer comes from.

    A GitHub Actions runner release: ``version`` and ``sha256`` (default: the lock's
    ``runner``), fetched from ``url`` (``{version}`` is replaced; default: the lock's URL, i.e.
    GitHub's release asset) or read from ``tarball``; either way its sha256 must equal ``sha256``.
    Or, for tests and the development stack, ``standin_python``: a ``run.sh`` that runs the
    GitHub stand-in's runner (``PYTHON -m impvm.devstack.standin_runner``) with that interpreter,
    which the runtime shares into the VM.
    """

    version: str | None = None
    sha256: str | None = None
    url: str | None = None
    tarball: Path | None = None
    standin_python: str | None = None


@dataclass
class BuildOptions:
    """``images``: names to build (default all); ``use_cache``: reuse tagged results (False:
    build everything again, into the same cache layout, e.g. to check reproducibility);
    ``log``: progress lines."""

    lock_path: Path = DEFAULT_LOCK
    cache_dir: Path = DEFAULT_CACHE
    runner: RunnerSource = field(default_factory=RunnerSource)
    images: tuple[str, ...] = tuple(s.name for s in IMAGES)
    update_lock: bool = False
    use_cache: bool = True
    #: the OCI layout to build into (default ``cache_dir/oci``); wheels and .deb files are
    #: always taken from ``cache_dir``
    layout_dir: Path | None = None
    #: with ``use_cache=False``: still take Debian roots already in the layout
    reuse_roots: bool = False
    project_root: Path = PROJECT_ROOT
    #: the cosign binary for the agent image (default: the pinned build, made when missing)
    cosign: Path | None = None
    #: the most the runner tarball may unpack to, in bytes
    runner_max_bytes: int = RUNNER_MAX_BYTES
    log: Callable[[str], None] = field(
        default=lambda line: print(f"images: {line}", file=sys.stderr, flush=True)
    )


@dataclass(frozen=True)
class BuiltImage:
    """A built image: ``layout``/``tag`` locate it, ``digest`` is its manifest digest
    (``sha256:<hex>``), ``size_bytes`` the sum of its compressed blobs (manifest, config, layers)
    and ``unpacked_bytes`` the sum of its layers' uncompressed sizes; ``cached``: it was there
    already."""

    name: str
    layout: Path
    tag: str
    digest: str
    size_bytes: int
    unpacked_bytes: int
    cached: bool
    #: tags (in ``layout``) of the Debian roots it was assembled from
    roots: tuple[str, ...] = ()

    @property
    def oci_ref(self) -> str:
        """The skopeo/podman reference ``oci:<layout>:<tag>``."""
        return f"oci:{self.layout}:{self.tag}"


# ---------------------------------------------------------------------------- reproducible tars


def _norm_mode(mode: int, is_dir: bool) -> int:
    if is_dir or mode & 0o111:
        return 0o755
    return 0o644


def write_tree_tar(
    tree: Path,
    out: Path,
    epoch: int,
    owner: Callable[[str], tuple[int, int]] = lambda _p: (0, 0),
) -> int:
    """Write every entry below ``tree`` (not ``tree`` itself) to the uncompressed tarball
    ``out``: sorted by path, mtimes clamped to ``epoch``, modes normalised (directories and
    executables 0755, other files 0644), owner ``owner(path)`` (uid, gid), no user/group names.
    Returns the sum of the regular files' sizes in bytes. Hard links within the tree stay hard
    links; device nodes are refused (``ImageBuildError``)."""
    total = 0
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in _sorted_walk(tree):
            rel = path.relative_to(tree).as_posix()
            info = tar.gettarinfo(str(path), arcname=rel)
            if info.ischr() or info.isblk() or info.isfifo():
                raise ImageBuildError(f"{rel}: device nodes and FIFOs do not belong in a layer")
            info.uid, info.gid = owner(rel)
            info.uname = info.gname = ""
            info.mtime = min(int(info.mtime), epoch)
            if not info.issym():
                info.mode = _norm_mode(info.mode, info.isdir())
            if info.isreg():
                total += info.size
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return total


def _sorted_walk(tree: Path) -> Iterator[Path]:
    for entry in sorted(tree.iterdir(), key=lambda p: p.name):
        yield entry
        if entry.is_dir() and not entry.is_symlink():
            yield from _sorted_walk(entry)


def drop_device_nodes(src: Path, dst: Path) -> int:
    """Copy the tarball ``src`` to ``dst`` without character/block devices and FIFOs (mmdebstrap
    puts ``/dev`` nodes into its tarball; an OCI layer has none, the runtime provides ``/dev``).
    Order and headers are kept. Returns the sum of the regular files' sizes in bytes."""
    total = 0
    with tarfile.open(src) as inp, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as out:
        for m in inp:
            if m.ischr() or m.isblk() or m.isfifo():
                continue
            if m.isreg():
                total += m.size
                out.addfile(m, inp.extractfile(m))
            else:
                out.addfile(m)
    return total


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_runner_tarball(path: Path, expected: str, version: str) -> None:
    """Raise :class:`RunnerChecksumError` unless ``sha256(path) == expected``."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise RunnerChecksumError(
            f"{path.name}: sha256 is {actual}, but the checksum published for runner "
            f"{version} is {expected}; refusing to build the runner layer from it"
        )


def _created(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------- the builder


class Builder:
    """One build run (see the module docstring). ``await Builder(opts).run()``."""

    def __init__(self, opts: BuildOptions) -> None:
        self.opts = opts
        self.cache = opts.cache_dir
        self.layout = opts.layout_dir or self.cache / "oci"
        self.lock: Lock | None = None
        self.lock_changed = False
        #: layer name ("root:<name>", "app", "runner") -> (key, tag or tar path, unpacked size)
        self._layer_keys: dict[str, str] = {}
        self._wheels_checked = False
        #: versions of the tools whose output the digests depend on (part of every key)
        self.tools = ""

    def log(self, line: str) -> None:
        self.opts.log(line)

    async def _run(self, what: str, *args: str, env: dict[str, str] | None = None) -> bytes:
        if env is None:
            return await run_tool(what, *args, error=ImageBuildError)
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            detail = (err or out).decode(errors="replace").strip()[-2000:]
            raise ImageBuildError(f"{what} failed (exit {proc.returncode}): {detail}")
        return out

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        self.cache.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.cache / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    async def run(self) -> list[BuiltImage]:
        """Build (or reuse) every requested image; returns them in request order. Raises
        :class:`ImageBuildError` (a step failed, a checksum differs) or
        :class:`impvm.images.spec.LockError` (the lock is malformed or the build drifted)."""
        for name in self.opts.images:
            try:
                image_spec(name)
            except KeyError:
                known = ", ".join(s.name for s in IMAGES)
                raise ImageBuildError(f"unknown image {name!r} (known: {known})") from None
        if os.geteuid() != 0:
            raise ImageBuildError("building images needs root (mmdebstrap uses chroot)")
        async with self._exclusive():
            self.lock = load_lock(self.opts.lock_path.read_text())
            versions = [
                (await self._run(f"{t} --version", t, "--version")).decode().strip()
                for t in ("mmdebstrap", "umoci")
            ]
            self.tools = "\n".join(versions)
            tmp = self._mkdir(self.cache / "tmp")
            await asyncio.to_thread(_clear_stale, tmp, self.log)
            work = Path(tempfile.mkdtemp(prefix="build-", dir=tmp))
            try:
                if not (self.layout / "index.json").exists():
                    await self._run("umoci init", "umoci", "init", "--layout", str(self.layout))
                out = [await self._image(image_spec(n), work) for n in self.opts.images]
                await self._prune([b.tag for b in out])
            finally:
                await asyncio.to_thread(shutil.rmtree, work, True)
            return out

    def _record_lock(self) -> None:
        """Write the updated lock at once, so a later failure keeps what was learnt."""
        self.lock_changed = True
        self.opts.lock_path.write_text(dump_lock(self._lock()))
        self.log(f"lock updated: {self.opts.lock_path}")

    @staticmethod
    def _mkdir(p: Path) -> Path:
        p.mkdir(parents=True, exist_ok=True)
        return p

    # ------------------------------------------------------------------ layout helpers

    def _index(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads((self.layout / "index.json").read_text())
        except (OSError, ValueError):
            return {}
        out = {}
        for m in data.get("manifests") or []:
            tag = (m.get("annotations") or {}).get("org.opencontainers.image.ref.name")
            if tag:
                out[tag] = m
        return out

    def _blob(self, digest: str) -> bytes:
        algo, _, hexd = digest.partition(":")
        return (self.layout / "blobs" / algo / hexd).read_bytes()

    def _built(self, name: str, tag: str, cached: bool, roots: tuple[str, ...] = ()) -> BuiltImage:
        desc = self._index()[tag]
        digest = str(desc["digest"])
        manifest = json.loads(self._blob(digest))
        size = int(str(desc["size"])) + int(manifest["config"]["size"])
        size += sum(int(layer["size"]) for layer in manifest["layers"])
        meta = self._meta(tag)
        return BuiltImage(
            name=name,
            layout=self.layout,
            tag=tag,
            digest=digest,
            size_bytes=size,
            unpacked_bytes=int(str(meta.get("unpacked_bytes", 0))),
            cached=cached,
            roots=roots,
        )

    def _meta_path(self, tag: str) -> Path:
        return self._mkdir(self.layout.parent / f"{self.layout.name}.meta") / f"{tag}.json"

    def _meta(self, tag: str) -> dict[str, object]:
        try:
            data: dict[str, object] = json.loads(self._meta_path(tag).read_text())
            return data
        except (OSError, ValueError):
            return {}

    def _cached(self, tag: str, root: bool = False) -> bool:
        use = self.opts.use_cache or (root and self.opts.reuse_roots)
        return use and tag in self._index() and bool(self._meta(tag))

    async def _prune(self, keep: list[str]) -> None:
        """Remove tags of the built images' names (and roots) other than the current ones, then
        garbage-collect unreferenced blobs."""
        keep_set = set(keep) | set(self._layer_keys.values())
        names = {t.rsplit("-", 1)[0] for t in keep_set}
        removed = False
        for tag in self._index():
            if tag not in keep_set and tag.rsplit("-", 1)[0] in names:
                await self._run("umoci rm", "umoci", "rm", "--image", f"{self.layout}:{tag}")
                with contextlib.suppress(OSError):
                    self._meta_path(tag).unlink()
                removed = True
        if removed:
            await self._run("umoci gc", "umoci", "gc", "--layout", str(self.layout))

    # ------------------------------------------------------------------ images

    async def _image(self, spec: ImageSpec, work: Path) -> BuiltImage:
        assert self.lock is not None
        layers: list[tuple[str, str, Path | None, int]] = []  # (kind, key, tar, unpacked)
        for layer in spec.layers:
            layers.append(await self._layer(layer, work))
        key = input_key(
            repr(spec),
            self.tools,
            str(self.lock.debian.source_date_epoch),
            *(k for _, k, _, _ in layers),
        )
        tag = f"{spec.name}-{key[:16]}"
        roots = tuple(k for kind, k, _, _ in layers if kind.startswith("root:"))
        if self._cached(tag):
            self.log(f"{spec.name}: cached ({tag})")
            return self._built(spec.name, tag, cached=True, roots=roots)
        self.log(f"{spec.name}: assembling {tag}")
        created = _created(self.lock.debian.source_date_epoch)
        ref = f"{self.layout}:{tag}"
        first_kind, first_key, _, _ = layers[0]
        with contextlib.suppress(ImageBuildError):
            await self._run("umoci rm", "umoci", "rm", "--image", ref)
        if first_kind.startswith("root:"):
            await self._run(
                "umoci tag", "umoci", "tag", "--image", f"{self.layout}:{first_key}", tag
            )
            rest = layers[1:]
        else:
            await self._run("umoci new", "umoci", "new", "--image", ref)
            rest = layers
        for kind, _, tar, _ in rest:
            assert tar is not None
            await self._run(
                f"adding the {kind} layer to {spec.name}",
                "umoci",
                "raw",
                "add-layer",
                "--image",
                ref,
                "--history.created",
                created,
                "--history.created_by",
                f"impvm images build ({kind})",
                str(tar),
            )
        await self._run(
            f"configuring {spec.name}",
            "umoci",
            "config",
            "--image",
            ref,
            *image_config_args(spec, created),
        )
        unpacked = sum(u for _, _, _, u in layers)
        self._meta_path(tag).write_text(json.dumps({"unpacked_bytes": unpacked}) + "\n")
        return self._built(spec.name, tag, cached=False, roots=roots)

    async def _layer(self, layer: str, work: Path) -> tuple[str, str, Path | None, int]:
        """Returns (kind, key, tar path or None for a root, unpacked bytes). For a root the key
        is its tag in the layout."""
        if layer.startswith("root:"):
            tag = await self._root(layer.removeprefix("root:"), work)
            self._layer_keys[layer] = tag
            return layer, tag, None, int(str(self._meta(tag).get("unpacked_bytes", 0)))
        make = {"app": self._app_layer, "cosign": self._cosign_layer, "runner": self._runner_layer}
        if layer in make:
            tar, size_file = work / f"{layer}.tar", work / f"{layer}.size"
            if not tar.exists():  # each layer once per build, however many images share it
                size_file.write_text(str(await make[layer](work, tar)))
            key = await asyncio.to_thread(sha256_file, tar)
            return layer, key, tar, int(size_file.read_text())
        raise ImageBuildError(f"unknown layer {layer!r}")

    # ------------------------------------------------------------------ Debian roots

    def _hook(self, root: str, wheels: Path, dpkg_out: Path) -> str:
        """The mmdebstrap customize hook (``sh -c``, ``$1`` = the root)."""
        spec = root_spec(root)
        lines = [
            "set -eu",
            'r="$1"',
            # host-specific files (mmdebstrap copies the host's): not part of an image
            'rm -f "$r/etc/resolv.conf" "$r/etc/hostname"',
        ]
        for user, uid in spec.users:
            home = f"/home/{user}" if user == "runner" else "/nonexistent"
            create = "--create-home" if user == "runner" else "--no-create-home"
            lines += [
                f'chroot "$r" groupadd --gid {uid} {user}',
                f'chroot "$r" useradd --uid {uid} --gid {uid} {create} --home-dir {home} '
                f"--shell {'/bin/bash' if user == 'runner' else '/usr/sbin/nologin'} {user}",
            ]
            if user == "runner":
                lines += [
                    'chmod 0755 "$r/home/runner"',
                    'mkdir -p "$r/home/runner/_work"',
                    f'chown {uid}:{uid} "$r/home/runner/_work"',
                ]
        if spec.venv:
            pip = next(w for w in self._lock().wheels if w.name.lower() == _PIP)
            lines += [
                f'chroot "$r" python3 -m venv --without-pip {VENV}',
                'mkdir "$r/tmp/impvm-wheels"',
                f'cp {shlex.quote(str(wheels))}/*.whl "$r/tmp/impvm-wheels/"',
                f'cp {shlex.quote(str(wheels / "requirements.txt"))} "$r/tmp/impvm-wheels/"',
                f'chroot "$r" {VENV}/bin/python /tmp/impvm-wheels/{pip.file}/pip install -q '
                "--no-index --no-cache-dir --no-compile --disable-pip-version-check "
                "--require-hashes --find-links /tmp/impvm-wheels "
                "-r /tmp/impvm-wheels/requirements.txt",
                'rm -rf "$r/tmp/impvm-wheels"',
                # byte-code once, at build time (the root filesystem is read-only at run time);
                # unchecked-hash .pyc files carry no timestamp
                f'chroot "$r" {VENV}/bin/python -m compileall -q -j0 '
                f"--invalidation-mode unchecked-hash {PYTHON_SITE} >/dev/null",
            ]
        if spec.drop_initrd:
            lines.append('rm -f "$r"/boot/initrd.img-*')
        lines.append(
            "chroot \"$r\" dpkg-query -W -f '${Package} ${Version}\\n' > "
            + shlex.quote(str(dpkg_out))
        )
        return "\n".join(lines) + "\n"

    def _recipe(self, root: str) -> str:
        """What besides the lock makes a root: the hook (with placeholder paths), the tools."""
        return self._hook(root, Path("/W"), Path("/D")) + self.tools

    def _lock(self) -> Lock:
        assert self.lock is not None
        return self.lock

    async def _root(self, root: str, work: Path) -> str:
        lock = self._lock()
        spec = root_spec(root)
        wheels = await self._wheels() if spec.venv else self.cache / "wheels"
        # the hook's text with fixed placeholder paths is part of the key
        key = root_key(lock, root, self._recipe(root))
        tag = f"root-{root}-{key[:16]}"
        if self._cached(tag, root=True):
            self.log(f"{root}: cached Debian root ({tag})")
            return tag
        rl = lock.roots[root]
        self.log(f"{root}: mmdebstrap {lock.debian.suite} with {', '.join(rl.include)}")
        tmp = self._mkdir(work / f"root-{root}")
        raw, tar, dpkg = tmp / "raw.tar", tmp / "root.tar", tmp / "dpkg.txt"
        hook = tmp / "hook.sh"
        hook.write_text(self._hook(root, wheels, dpkg))
        debs = self._mkdir(self.cache / "debs" / root)
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "SOURCE_DATE_EPOCH": str(lock.debian.source_date_epoch),
            "TMPDIR": str(tmp),
            "LC_ALL": "C.UTF-8",
        }
        started = time.monotonic()
        await self._run(
            f"mmdebstrap ({root})",
            "mmdebstrap",
            "--quiet",
            *MMDEBSTRAP_OPTIONS,
            "--skip=essential/unlink",
            f"--include={','.join(rl.include)}",
            '--setup-hook=mkdir -p "$1/var/cache/apt/archives"',
            f"--setup-hook=sync-in {debs} /var/cache/apt/archives",
            f"--customize-hook=sync-out /var/cache/apt/archives {debs}",
            f'--customize-hook=sh {hook} "$1"',
            lock.debian.suite,
            str(raw),
            *lock.debian.sources,
            env=env,
        )
        self.log(f"{root}: mmdebstrap took {time.monotonic() - started:.0f}s")
        installed = parse_dpkg_list(dpkg.read_text())
        await asyncio.to_thread(_prune_debs, debs, installed)
        drift = package_drift(rl.packages, installed)
        if drift:
            if not self.opts.update_lock:
                shown = "; ".join(drift[:20]) + ("; ..." if len(drift) > 20 else "")
                raise LockError(
                    f"Debian root {root} differs from the lock ({len(drift)} packages: {shown}). "
                    "The archive moved on: rebuild with --update-lock to record the new "
                    "versions (a new input), or point debian.sources at a snapshot"
                )
            lock.roots[root] = RootLock(include=rl.include, packages=installed)
            self._record_lock()
            key = root_key(lock, root, self._recipe(root))
            tag = f"root-{root}-{key[:16]}"
        unpacked = await asyncio.to_thread(drop_device_nodes, raw, tar)
        raw.unlink()
        created = _created(lock.debian.source_date_epoch)
        ref = f"{self.layout}:{tag}"
        with contextlib.suppress(ImageBuildError):
            await self._run("umoci rm", "umoci", "rm", "--image", ref)
        await self._run("umoci new", "umoci", "new", "--image", ref)
        await self._run(
            f"adding the {root} layer",
            "umoci",
            "raw",
            "add-layer",
            "--image",
            ref,
            "--history.created",
            created,
            "--history.created_by",
            f"mmdebstrap {lock.debian.suite} ({root})",
            str(tar),
        )
        tar.unlink()
        self._meta_path(tag).write_text(json.dumps({"unpacked_bytes": unpacked}) + "\n")
        return tag

    # ------------------------------------------------------------------ wheels

    def _pip(self) -> list[str]:
        return [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]

    #: wheels for Debian 12's CPython 3.11 on x86-64 (glibc 2.36): pip takes the platform tags
    #: literally, so every compatible manylinux tag is listed
    _PLATFORM = (
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        "3.11",
        "--abi",
        "cp311",
        *(
            a
            for tag in [f"manylinux_2_{m}_x86_64" for m in range(36, 4, -1)]
            + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
            for a in ("--platform", tag)
        ),
    )

    async def _wheels(self) -> Path:
        """The locked wheels in ``cache/wheels`` (downloaded when missing, each checked against
        its sha256) and a hash-pinned ``requirements.txt`` of all but pip. With
        ``update_lock``: resolve the runtime dependencies of impvm under ``constraints.txt``
        first and record them."""
        lock = self._lock()
        wheels = self._mkdir(self.cache / "wheels")
        if self.opts.update_lock and not self._wheels_checked:
            self._wheels_checked = True
            constraints = (self.opts.project_root / "constraints.txt").read_text()
            direct = [re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in _runtime_requirements()]
            if not wheels_follow_constraints(lock.wheels, parse_constraints(constraints), direct):
                await self._resolve_wheels(wheels)
        missing = [
            w
            for w in lock.wheels
            if not (wheels / w.file).is_file() or sha256_file(wheels / w.file) != w.sha256
        ]
        if missing:
            self.log(f"downloading {len(missing)} wheels")
            req = wheels / "download.txt"
            req.write_text(requirements_with_hashes(missing))
            await self._run(
                "pip download",
                *self._pip(),
                "download",
                "--no-deps",
                "--require-hashes",
                *self._PLATFORM,
                "-d",
                str(wheels),
                "-r",
                str(req),
            )
            for w in missing:
                if sha256_file(wheels / w.file) != w.sha256:
                    raise ImageBuildError(f"{w.file}: sha256 differs from the lock")
        (wheels / "requirements.txt").write_text(requirements_with_hashes(lock.wheels, (_PIP,)))
        return wheels

    async def _resolve_wheels(self, wheels: Path) -> None:
        lock = self._lock()
        deps = _runtime_requirements()
        pip_version = importlib.metadata.version("pip")
        tmp = Path(tempfile.mkdtemp(dir=wheels))
        try:
            await self._run(
                "pip download (resolving the wheels)",
                *self._pip(),
                "download",
                *self._PLATFORM,
                "-c",
                str(self.opts.project_root / "constraints.txt"),
                "-d",
                str(tmp),
                f"pip=={pip_version}",
                *deps,
            )
            found = await asyncio.to_thread(_collect_wheels, tmp, wheels)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if sorted(w.model_dump_json() for w in found) != sorted(
            w.model_dump_json() for w in lock.wheels
        ):
            lock.wheels = found
            self._record_lock()

    # ------------------------------------------------------------------ impvm package layer

    async def _app_layer(self, work: Path, out: Path) -> int:
        """The impvm package (wheel built from the source tree) installed into ``PYTHON_SITE``
        plus the ``impvm`` command, as a tarball; returns its unpacked size."""
        lock = self._lock()
        dist = self._mkdir(work / "dist")
        self.log("impvm: building the wheel from the source tree")
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(lock.debian.source_date_epoch))
        # build from a clean copy: setuptools reuses (and would ship stale files of) an in-tree
        # build/ directory, and the checkout stays untouched
        source = work / "source"
        await asyncio.to_thread(_copy_source, self.opts.project_root, source)
        await self._run(
            "pip wheel (impvm)",
            *self._pip(),
            "wheel",
            "--no-deps",
            "-w",
            str(dist),
            str(source),
            env=env,
        )
        stage = work / "app"
        site = stage / PYTHON_SITE.lstrip("/")
        version = importlib.metadata.version("impvm")
        # byte-code below is compiled for the image's paths; the building interpreter must be
        # CPython 3.11 like the image's (same byte-code magic number)
        if sys.version_info[:2] != (3, 11):
            raise ImageBuildError("building the impvm layer needs CPython 3.11 (the image's)")
        await self._run(
            "pip install (impvm, into the layer)",
            *self._pip(),
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--find-links",
            str(dist),
            "--target",
            str(site),
            f"impvm=={version}",
        )
        # pip --target writes scripts for the building interpreter: the image gets its own
        shutil.rmtree(site / "bin", ignore_errors=True)
        for junk in site.glob("*.dist-info/direct_url.json"):
            junk.unlink()
        script = stage / VENV.lstrip("/") / "bin" / "impvm"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(
            f"#!{VENV}/bin/python\nimport sys\n\nfrom impvm.cli import app\n\nsys.exit(app())\n"
        )
        script.chmod(0o755)
        await self._run(
            "compiling impvm to byte-code",
            sys.executable,
            "-m",
            "compileall",
            "-q",
            "-j0",
            "--invalidation-mode",
            "unchecked-hash",
            "-s",
            str(stage),
            "-p",
            "/",
            str(site / "impvm"),
        )
        return await asyncio.to_thread(write_tree_tar, stage, out, lock.debian.source_date_epoch)

    # ------------------------------------------------------------------ cosign layer

    async def _cosign_layer(self, work: Path, out: Path) -> int:
        """``COSIGN_PATH`` (root, 0755) from ``opts.cosign`` or the pinned build; returns the
        layer's unpacked size."""
        binary = self.opts.cosign
        if binary is None:
            try:
                binary = await asyncio.to_thread(cosign_binary)
            except SigningError as e:
                raise ImageBuildError(f"the agent image needs cosign: {e}") from None
        if not binary.is_file():
            raise ImageBuildError(f"cosign: {binary}: no such file")
        stage = work / "cosign"
        dest = stage / COSIGN_PATH.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shutil.copyfile, binary, dest)
        dest.chmod(0o755)
        self.log(f"impvm-agent: cosign {binary} (sha256 {sha256_file(dest)})")
        lock = self._lock()
        return await asyncio.to_thread(write_tree_tar, stage, out, lock.debian.source_date_epoch)

    # ------------------------------------------------------------------ runner layer

    async def _runner_layer(self, work: Path, out: Path) -> int:
        lock = self._lock()
        src = self.opts.runner
        stage = work / "runner"
        home = stage / RUNNER_HOME.lstrip("/")
        home.mkdir(parents=True)
        if src.standin_python:
            self.log("runner-layer: the stand-in runner (tests and development only)")
            run_sh = home / "run.sh"
            run_sh.write_text(standin_run_sh(src.standin_python))
            run_sh.chmod(0o755)
        else:
            release, tarball = await self._runner_tarball(lock)
            self.log(f"runner-layer: GitHub Actions runner {release.version}")
            await asyncio.to_thread(_extract_runner, tarball, home, self.opts.runner_max_bytes)
        wrapper = stage / RUNNER_WRAPPER.lstrip("/")
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        wrapper.write_bytes(runner_wrapper_script())
        wrapper.chmod(0o755)

        def owner(rel: str) -> tuple[int, int]:
            if rel == "home/runner" or rel.startswith("home/runner/"):
                return RUNNER_UID, RUNNER_UID
            return 0, 0

        return await asyncio.to_thread(
            write_tree_tar, stage, out, lock.debian.source_date_epoch, owner
        )

    async def _runner_tarball(self, lock: Lock) -> tuple[RunnerRelease, Path]:
        src = self.opts.runner
        version = src.version or lock.runner.version
        sha = src.sha256
        if sha is None and version == lock.runner.version:
            sha = lock.runner.sha256
        if sha is None:
            raise ImageBuildError(
                f"runner {version}: give its published sha256 (--runner-sha256); the lock "
                f"only knows {lock.runner.version}"
            )
        release = RunnerRelease(version=version, sha256=sha, url=src.url or lock.runner.url)
        if src.tarball is not None:
            await asyncio.to_thread(verify_runner_tarball, src.tarball, release.sha256, version)
            return release, src.tarball
        downloads = self._mkdir(self.cache / "downloads")
        name = release.download_url().rsplit("/", 1)[-1] or f"actions-runner-{version}.tar.gz"
        dest = downloads / f"{release.sha256[:16]}-{name}"
        if dest.is_file():
            await asyncio.to_thread(verify_runner_tarball, dest, release.sha256, version)
            return release, dest
        tmp = downloads / f".{dest.name}.part"
        self.log(f"runner-layer: downloading {release.download_url()}")
        await _download(release.download_url(), tmp)
        try:
            await asyncio.to_thread(verify_runner_tarball, tmp, release.sha256, version)
        except RunnerChecksumError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, dest)
        return release, dest


def _extract_runner(tarball: Path, dest: Path, max_bytes: int = RUNNER_MAX_BYTES) -> None:
    """Unpack the runner release into ``dest``: first read whole without writing anything
    (:func:`impvm.agent.layers.scan_layer`: no entry, hard link or relative symlink leaving
    ``dest``, no device node, no entry below a symlink of the archive, at most ``max_bytes``
    unpacked), then extracted with tarfile's ``data`` filter (no absolute paths, no links
    leaving ``dest``, no set-uid bits). Raises :class:`ImageBuildError`."""
    try:
        scan_layer(
            tarball, Budget(max_bytes), f"runner tarball {tarball.name}", through_links=False
        )
    except ImageError as exc:
        raise ImageBuildError(str(exc)) from None
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ImageBuildError(f"unpacking {tarball.name} failed: {exc}") from None
    if not (dest / "run.sh").is_file():
        raise ImageBuildError(f"{tarball.name} has no run.sh: not a GitHub Actions runner")


async def _download(url: str, dest: Path) -> None:
    import httpx

    try:
        async with (
            httpx.AsyncClient(follow_redirects=True, timeout=60.0) as http,
            http.stream("GET", url) as resp,
        ):
            resp.raise_for_status()
            with dest.open("wb") as f:
                async for chunk in resp.aiter_bytes(_CHUNK):
                    f.write(chunk)
    except httpx.HTTPError as exc:
        await asyncio.to_thread(dest.unlink, missing_ok=True)
        raise ImageBuildError(f"downloading {url} failed: {type(exc).__name__}: {exc}") from None


def _clear_stale(tmp: Path, log: Callable[[str], None]) -> None:
    """Remove work directories an interrupted build left in ``tmp`` (builds hold the cache lock,
    so none is in use), except one with something still mounted below it (a killed mmdebstrap's
    chroot mounts): removing that could reach the host's /dev or /proc."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    points = [line.split()[1] for line in mounts if len(line.split()) > 1]
    for d in tmp.glob("build-*"):
        if any(p == str(d) or p.startswith(f"{d}/") for p in points):
            log(f"leaving {d}: something is still mounted below it")
            continue
        shutil.rmtree(d, ignore_errors=True)


def _copy_source(root: Path, dest: Path) -> None:
    """The files the impvm wheel is built from (``pyproject.toml``, ``README.md``, ``src/``),
    without byte-code and build metadata."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(root / name, dest / name)
    shutil.copytree(
        root / "src",
        dest / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )


def _collect_wheels(tmp: Path, wheels: Path) -> list[WheelLock]:
    """Move the wheels pip downloaded into ``tmp`` to ``wheels``; returns their lock entries."""
    found = []
    for f in sorted(tmp.glob("*.whl")):
        found.append(wheel_from_file(f.name, sha256_file(f)))
        os.replace(f, wheels / f.name)
    return found


def _runtime_requirements() -> list[str]:
    """impvm's runtime requirements (no extras), as its installed metadata lists them."""
    reqs = importlib.metadata.requires("impvm") or []
    return [r for r in reqs if "extra" not in r.partition(";")[2]]


_DEB_RE = re.compile(r"^([^_]+)_([^_]+)_[^_]+\.deb$")


def _prune_debs(debs: Path, installed: dict[str, str]) -> None:
    """Keep only the .deb files of the packages (and versions) a root now has."""
    for f in debs.glob("*.deb"):
        m = _DEB_RE.match(f.name)
        if m is None or installed.get(m.group(1)) != m.group(2).replace("%3a", ":"):
            f.unlink(missing_ok=True)


async def build_images(opts: BuildOptions) -> list[BuiltImage]:
    """Build (or reuse) the images; see :class:`Builder`."""
    return await Builder(opts).run()


async def copy_image(image: BuiltImage, dest: str, insecure: bool = False) -> str:
    """``skopeo copy`` an image to ``dest`` (a skopeo destination such as
    ``docker://HOST/REPO:TAG`` or ``oci:DIR:TAG``); returns the digest skopeo reports, which must
    be the built digest (``ImageBuildError`` otherwise)."""
    with tempfile.TemporaryDirectory() as tmp:
        digest_file = Path(tmp) / "digest"
        tls = ["--dest-tls-verify=false"] if insecure and dest.startswith("docker://") else []
        await run_tool(
            f"copying {image.name} to {dest}",
            "skopeo",
            "copy",
            "--quiet",
            "--preserve-digests",
            *tls,
            "--digestfile",
            str(digest_file),
            "--",  # neither is ever an option, whatever it looks like
            image.oci_ref,
            dest,
            error=ImageBuildError,
        )
        got = digest_file.read_text().strip()
    if got != image.digest:
        raise ImageBuildError(f"{image.name}: {dest} has digest {got}, built {image.digest}")
    return got
