"""Feasibility probe: snapshot and restore of a booted guest with the host's QEMU (Debian 12's
7.2), against a cold boot of the same guest, measured in one run.

It does not touch the agent's runtime. It boots the agent's guest kernel (its PVH image when it
has one, as the agent boots it; TCG, QEMU's ``microvm`` machine, 1 vCPU, ``--memory`` MiB) with
a busybox initramfs of its own whose init says ``PROBE ready`` on the serial port and then
answers each ``ping`` line with ``pong``, the guest's wall clock and 16 bytes of
``/dev/urandom``. Guest RAM is a ``memory-backend-file`` in ``/dev/shm``. Then:

1. **cold**: ``--runs`` boots, each timed from QEMU's start to ``PROBE ready`` (the point a
   template guest would be saved at: booted, before it needs its JIT config);
2. **template**: two more boots, each paused and saved once over QMP (QEMU refuses a second
   migration of a guest a migration paused): a migration with RAM in the stream (``migrate
   exec:cat > FILE``; QEMU 7.2 has no ``file:`` URI, 8.2 does), and one with the
   ``x-ignore-shared`` capability (the RAM of a ``share=on`` file-backed memory backend is left
   out of the stream: the file *is* the memory). A template never resumes;
3. **restore**, ``--age`` seconds later: ``--runs`` restores of each (``-incoming defer``,
   ``migrate-incoming exec:cat FILE``), each timed from QEMU's start to the guest's ``pong``:
   the full stream into anonymous RAM, and the ``x-ignore-shared`` state onto the template's
   memory file mapped **private** (``share=off``: each clone's writes are copy-on-write, the
   file stays as saved; Kata's VM templating);
4. what QEMU 7.2 offers for it (``query-migrate-capabilities``, the ``file:`` URI, the
   ``vmgenid`` device), and what the clones of one snapshot read from ``/dev/urandom`` and say
   the time is (Firecracker's "snapshot security and uniqueness": without a reseed they read
   the same bytes; their clocks stand where the template's stopped).

Prints one line per sample, then ``snapshot-probe: cold boot p50 X s, restore (ignore-shared)
p50 Y s (Z x), restore (full stream) p50 W s`` and the findings. Everything is made under a
temporary directory and ``/dev/shm`` and removed; each QEMU is killed at the end of its step.
No network: the guest has no network device.

    .venv/bin/python benchmarks/snapshot_probe.py [--runs 3] [--memory 512] [--age 10]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impvm.agent.qemu_accel import kernel_args
from impvm.agent.qemu_guest import find_kernel, pvh_image

QEMU = "qemu-system-x86_64"
BUSYBOX = "/bin/busybox"
INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
echo "PROBE ready $(date +%s)"
while read -r line; do
    if [ "$line" = ping ]; then
        echo "pong $(date +%s) $(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')"
    fi
done </dev/ttyS0 >/dev/ttyS0
"""


def build_initramfs(work: Path) -> Path:
    """A newc cpio with busybox and :data:`INIT` (made with ``cpio``)."""
    root = work / "initramfs"
    for d in ("bin", "proc", "dev", "sys"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    (root / "init").write_text(INIT)
    (root / "init").chmod(0o755)
    out = work / "initramfs.cpio"
    names = subprocess.run(
        ["find", ".", "-print"], cwd=root, capture_output=True, check=True
    ).stdout
    with out.open("wb") as f:
        subprocess.run(
            ["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=names, stdout=f, check=True
        )
    return out


@dataclass
class Guest:
    """One QEMU process with a QMP socket and the serial port on a socket."""

    work: Path
    name: str
    proc: asyncio.subprocess.Process | None = None
    qmp: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    serial: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    started: float = 0.0
    lines: list[str] = field(default_factory=list)
    #: the incoming migration left the guest paused and it was continued (``cont``)
    continued: bool = False

    @property
    def qmp_path(self) -> Path:
        return self.work / f"{self.name}.qmp"

    @property
    def serial_path(self) -> Path:
        return self.work / f"{self.name}.serial"

    async def start(self, argv: list[str]) -> None:
        self.started = time.monotonic()
        self.proc = await asyncio.create_subprocess_exec(
            QEMU,
            *argv,
            "-qmp",
            f"unix:{self.qmp_path},server=on,wait=off",
            "-chardev",
            f"socket,id=ser0,path={self.serial_path},server=on,wait=off",
            "-serial",
            "chardev:ser0",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self.qmp = await self._connect(self.qmp_path)
        await self.qmp[0].readline()  # the greeting
        await self.command("qmp_capabilities")
        self.serial = await self._connect(self.serial_path)

    async def _connect(
        self, path: Path, within: float = 30.0
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        deadline = time.monotonic() + within
        while True:
            try:
                return await asyncio.open_unix_connection(str(path), limit=1 << 20)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or self._exited():
                    raise RuntimeError(
                        f"{self.name}: QEMU did not open {path.name}: {await self._stderr()}"
                    ) from None
                await asyncio.sleep(0.005)

    def _exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None

    async def _stderr(self) -> str:
        if self.proc is None or self.proc.stderr is None or not self._exited():
            return ""
        return (await self.proc.stderr.read()).decode(errors="replace")[-500:]

    async def command(self, execute: str, **arguments: Any) -> Any:
        """One QMP command; its ``return`` (events are skipped); RuntimeError on an error."""
        assert self.qmp is not None
        r, w = self.qmp
        msg: dict[str, Any] = {"execute": execute}
        if arguments:
            msg["arguments"] = arguments
        w.write(json.dumps(msg).encode() + b"\n")
        await w.drain()
        while True:
            line = await asyncio.wait_for(r.readline(), 60)
            if not line:
                raise RuntimeError(f"{self.name}: QMP closed: {await self._stderr()}")
            reply = json.loads(line)
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise RuntimeError(f"{execute}: {reply['error'].get('desc')}")

    async def line_with(self, word: str, within: float = 120.0) -> str:
        """The next serial line containing ``word``."""
        assert self.serial is not None
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {word!r} on the serial port")
            line = await asyncio.wait_for(self.serial[0].readline(), left)
            if not line:
                raise RuntimeError(f"{self.name}: serial closed: {await self._stderr()}")
            text = line.decode(errors="replace").strip()
            self.lines.append(text)
            if word in text:
                return text

    async def ping(self, within: float = 60.0) -> str:
        assert self.serial is not None
        self.serial[1].write(b"ping\n")
        await self.serial[1].drain()
        return await self.line_with("pong", within)

    async def wait_migration(self, query: str = "query-migrate", within: float = 300.0) -> Any:
        deadline = time.monotonic() + within
        while True:
            st = await self.command(query)
            status = st.get("status")
            if status == "completed":
                return st
            if status == "failed":
                raise RuntimeError(f"{self.name}: migration failed: {st.get('error-desc')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: migration still {status}")
            await asyncio.sleep(0.01)

    async def wait_running(self, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while (status := (await self.command("query-status")).get("status")) != "running":
            if status == "paused":  # the incoming migration completed without autostart
                await self.command("cont")
                self.continued = True
                continue
            if time.monotonic() > deadline:
                mig = await self.command("query-migrate")
                raise TimeoutError(
                    f"{self.name}: {status} after the incoming migration: {mig}; "
                    f"{await self._stderr()}"
                )
            await asyncio.sleep(0.005)

    async def kill(self) -> None:
        for pair in (self.qmp, self.serial):
            if pair is not None:
                pair[1].close()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@dataclass
class Probe:
    work: Path
    kernel: Path
    initrd: Path
    memory: int
    shm: Path
    append: str

    def argv(self, *, mem_path: Path | None, share: bool, incoming: bool) -> list[str]:
        mib = f"{self.memory}M"
        if mem_path is None:
            backend = f"memory-backend-ram,id=mem,size={mib}"
        else:
            on = "on" if share else "off"
            backend = f"memory-backend-file,id=mem,size={mib},mem-path={mem_path},share={on}"
        argv = [
            "-machine",
            "microvm,memory-backend=mem",
            "-accel",
            "tcg",
            "-smp",
            "1",
            "-m",
            mib,
            "-object",
            backend,
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-kernel",
            str(self.kernel),
            "-initrd",
            str(self.initrd),
            "-append",
            self.append,
        ]
        return [*argv, "-incoming", "defer"] if incoming else argv

    async def cold(self, i: int) -> float:
        g = Guest(self.work, f"cold{i}")
        mem = self.shm / f"cold{i}.mem"
        try:
            await g.start(self.argv(mem_path=mem, share=True, incoming=False))
            await g.line_with("PROBE ready")
            return time.monotonic() - g.started
        finally:
            await g.kill()
            mem.unlink(missing_ok=True)

    async def template(self) -> dict[str, Any]:
        """Two template boots, each paused and saved once (QEMU refuses a second migration of
        a VM a migration paused): the full stream, and the ignore-shared state of a guest whose
        RAM is a ``share=on`` file; what 7.2 has."""
        found: dict[str, Any] = {}
        for kind in ("full", "shared"):
            g = Guest(self.work, f"template-{kind}")
            mem = self.shm / f"template-{kind}.mem"
            try:
                await g.start(self.argv(mem_path=mem, share=True, incoming=False))
                await g.line_with("PROBE ready")
                await g.ping()  # the guest answers before it is saved
                if kind == "full":
                    caps = await g.command("query-migrate-capabilities")
                    found["capabilities"] = sorted(c["capability"] for c in caps)
                await g.command("stop")
                if kind == "full":
                    try:
                        await g.command("migrate", uri=f"file:{self.work / 'state.file'}")
                        found["file_uri"] = "accepted"
                    except RuntimeError as e:
                        found["file_uri"] = f"refused: {e}"
                if kind == "shared":
                    caps_on = [{"capability": "x-ignore-shared", "state": True}]
                    await g.command("migrate-set-capabilities", capabilities=caps_on)
                state = self.work / f"state.{kind}"
                t0 = time.monotonic()
                await g.command("migrate", uri=f"exec:cat > {state}")
                await g.wait_migration()
                found[f"save_{kind}_s"] = time.monotonic() - t0
                found[kind] = state
            finally:
                await g.kill()  # the template never resumes
            found[f"size_{kind}"] = state.stat().st_size
            if kind == "shared":
                found["mem"] = mem
                found["mem_digest"] = digest(mem)
            else:
                mem.unlink(missing_ok=True)
        return found

    async def restore(
        self, i: int, state: Path, ignore_shared: bool, mem: Path
    ) -> tuple[float, str]:
        """Restore ``state``; seconds from QEMU's start to the guest's pong, and the pong."""
        g = Guest(self.work, f"restore{i}{'s' if ignore_shared else 'f'}")
        try:
            if ignore_shared:
                argv = self.argv(mem_path=mem, share=False, incoming=True)
            else:
                argv = self.argv(mem_path=None, share=False, incoming=True)
            await g.start(argv)
            if ignore_shared:
                caps_on = [{"capability": "x-ignore-shared", "state": True}]
                await g.command("migrate-set-capabilities", capabilities=caps_on)
            await g.command("migrate-incoming", uri=f"exec:cat {state}")
            await g.wait_running()
            pong = await g.ping()
            return time.monotonic() - g.started, pong + (" (continued)" if g.continued else "")
        finally:
            await g.kill()


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def qemu_facts() -> tuple[str, bool]:
    """QEMU's version line and whether it has the ``vmgenid`` device."""
    version = subprocess.run([QEMU, "--version"], capture_output=True, text=True, check=True)
    devices = subprocess.run([QEMU, "-device", "help"], capture_output=True, text=True)
    return version.stdout.splitlines()[0], "vmgenid" in devices.stdout


async def main(runs: int, memory: int, age: float) -> None:
    version, vmgenid = qemu_facts()
    k = find_kernel(need_shares=False)
    work = Path(tempfile.mkdtemp(prefix="impvm-snapshot-probe-"))
    shm = Path(tempfile.mkdtemp(prefix="impvm-snapshot-probe-", dir="/dev/shm"))
    try:
        k, why = await pvh_image(k, work / "kernel")
        append = " ".join(
            ["console=ttyS0", "quiet", "rdinit=/init", "panic=-1", *kernel_args("tcg", "microvm")]
        )
        probe = Probe(work, k.boot_image, build_initramfs(work), memory, shm, append)
        print(f"qemu: {version}")
        print(
            f"kernel {k.boot_image}{f' (bzImage: {why})' if why else ''}; TCG, microvm, "
            f"1 vCPU, {memory} MiB; load average {os.getloadavg()[0]:.1f}"
        )
        cold: list[float] = []
        for i in range(runs):
            cold.append(await probe.cold(i))
            print(f"  cold boot {i + 1}: {cold[-1]:.3f} s to PROBE ready", flush=True)
        t = await probe.template()
        print(
            f"  template saved: full stream {t['size_full'] / 2**20:.1f} MiB in "
            f"{t['save_full_s']:.2f} s; x-ignore-shared {t['size_shared'] / 2**10:.0f} KiB in "
            f"{t['save_shared_s']:.2f} s",
            flush=True,
        )
        await asyncio.sleep(age)  # the snapshot ages: do the clones know the time?
        full: list[float] = []
        shared: list[float] = []
        pongs: list[str] = []
        for i in range(runs):
            s, _ = await probe.restore(i, t["full"], False, t["mem"])
            full.append(s)
            print(f"  restore (full stream) {i + 1}: {s:.3f} s to pong", flush=True)
            s, pong = await probe.restore(i, t["shared"], True, t["mem"])
            shared.append(s)
            pongs.append(pong)
            print(
                f"  restore (x-ignore-shared, private) {i + 1}: {s:.3f} s to pong: {pong}",
                flush=True,
            )
        now = int(time.time())
        rand = [p.split()[2] for p in pongs if len(p.split()) >= 3]
        clocks = [int(p.split()[1]) for p in pongs if len(p.split()) >= 2]
        print(
            f"snapshot-probe: cold boot p50 {med(cold):.3f} s, restore (ignore-shared) p50 "
            f"{med(shared):.3f} s ({med(shared) / med(cold):.2f}x), restore (full stream) p50 "
            f"{med(full):.3f} s ({med(full) / med(cold):.2f}x), n={runs}"
        )
        print(f"  x-ignore-shared in 7.2's capabilities: {'x-ignore-shared' in t['capabilities']}")
        print(f"  capabilities: {', '.join(t['capabilities'])}")
        print(f"  migrate to a file: URI: {t['file_uri']}")
        print(
            f"  vmgenid device: {'present' if vmgenid else 'absent'} (needs ACPI: not on microvm "
            "without acpi=on)"
        )
        same = len(set(rand)) < len(rand)
        verdict = "the SAME bytes: the CRNG state was cloned" if same else "all differ"
        print(f"  clones' /dev/urandom: {len(set(rand))} distinct of {len(rand)} ({verdict})")
        if clocks:
            print(
                f"  clones' wall clock behind the host by {now - min(clocks)} s at most "
                "(the template's clock, until the guest is told the time)"
            )
        kept = digest(t["mem"]) == t["mem_digest"]
        print(
            f"  memory file: {t['mem'].stat().st_size / 2**20:.0f} MiB, "
            f"{'unchanged' if kept else 'CHANGED'} after {runs} private clones ran"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory", type=int, default=512, help="guest RAM, MiB")
    ap.add_argument(
        "--age", type=float, default=10.0, help="seconds between the save and the restores"
    )
    a = ap.parse_args()
    asyncio.run(main(a.runs, a.memory, a.age))
