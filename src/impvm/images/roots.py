"""The Debian roots: made by ``mmdebstrap`` with the customize hook (users, the virtual
environment with the locked wheels, the package list), checked against the lock (drift fails
with :class:`LockError` unless ``update_lock``), added to the layout as a one-layer image tagged
``root-<name>-<key>``; the .deb files kept per root in ``cache/debs``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import time
from pathlib import Path

from impvm.images.context import BuildContext, created_time
from impvm.images.keys import root_key
from impvm.images.lock import LockError, RootLock, package_drift, parse_dpkg_list
from impvm.images.options import ImageBuildError
from impvm.images.spec import MMDEBSTRAP_OPTIONS, PYTHON_SITE, VENV, root_spec
from impvm.images.tarballs import drop_device_nodes
from impvm.images.wheels import PIP, locked_wheels


def _hook(ctx: BuildContext, root: str, wheels: Path, dpkg_out: Path) -> str:
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
        pip = next(w for w in ctx.locked().wheels if w.name.lower() == PIP)
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
        "chroot \"$r\" dpkg-query -W -f '${Package} ${Version}\\n' > " + shlex.quote(str(dpkg_out))
    )
    return "\n".join(lines) + "\n"


def _recipe(ctx: BuildContext, root: str) -> str:
    """What besides the lock makes a root: the hook (with placeholder paths), the tools."""
    return _hook(ctx, root, Path("/W"), Path("/D")) + ctx.tools


async def build_root(ctx: BuildContext, root: str, work: Path) -> str:
    """The tag of the Debian root ``root`` in the layout (built, or taken from the cache)."""
    lock = ctx.locked()
    spec = root_spec(root)
    wheels = await locked_wheels(ctx) if spec.venv else ctx.cache / "wheels"
    # the hook's text with fixed placeholder paths is part of the key
    key = root_key(lock, root, _recipe(ctx, root))
    tag = f"root-{root}-{key[:16]}"
    if ctx.cached(tag, root=True):
        ctx.log(f"{root}: cached Debian root ({tag})")
        return tag
    rl = lock.roots[root]
    ctx.log(f"{root}: mmdebstrap {lock.debian.suite} with {', '.join(rl.include)}")
    tmp = ctx.mkdir(work / f"root-{root}")
    raw, tar, dpkg = tmp / "raw.tar", tmp / "root.tar", tmp / "dpkg.txt"
    hook = tmp / "hook.sh"
    hook.write_text(_hook(ctx, root, wheels, dpkg))
    debs = ctx.mkdir(ctx.cache / "debs" / root)
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "SOURCE_DATE_EPOCH": str(lock.debian.source_date_epoch),
        "TMPDIR": str(tmp),
        "LC_ALL": "C.UTF-8",
    }
    started = time.monotonic()
    await ctx.tool(
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
    ctx.log(f"{root}: mmdebstrap took {time.monotonic() - started:.0f}s")
    installed = parse_dpkg_list(dpkg.read_text())
    await asyncio.to_thread(_prune_debs, debs, installed)
    drift = package_drift(rl.packages, installed)
    if drift:
        if not ctx.opts.update_lock:
            shown = "; ".join(drift[:20]) + ("; ..." if len(drift) > 20 else "")
            raise LockError(
                f"Debian root {root} differs from the lock ({len(drift)} packages: {shown}). "
                "The archive moved on: rebuild with --update-lock to record the new "
                "versions (a new input), or point debian.sources at a snapshot"
            )
        lock.roots[root] = RootLock(include=rl.include, packages=installed)
        ctx.record_lock()
        key = root_key(lock, root, _recipe(ctx, root))
        tag = f"root-{root}-{key[:16]}"
    unpacked = await asyncio.to_thread(drop_device_nodes, raw, tar)
    raw.unlink()
    created = created_time(lock.debian.source_date_epoch)
    ref = f"{ctx.layout}:{tag}"
    with contextlib.suppress(ImageBuildError):
        await ctx.tool("umoci rm", "umoci", "rm", "--image", ref)
    await ctx.tool("umoci new", "umoci", "new", "--image", ref)
    await ctx.tool(
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
    ctx.meta_path(tag).write_text(json.dumps({"unpacked_bytes": unpacked}) + "\n")
    return tag


_DEB_RE = re.compile(r"^([^_]+)_([^_]+)_[^_]+\.deb$")


def _prune_debs(debs: Path, installed: dict[str, str]) -> None:
    """Keep only the .deb files of the packages (and versions) a root now has."""
    for f in debs.glob("*.deb"):
        m = _DEB_RE.match(f.name)
        if m is None or installed.get(m.group(1)) != m.group(2).replace("%3a", ":"):
            f.unlink(missing_ok=True)
