"""The node's guest networks, carried out: interfaces (``ip``, Debian ``iproute2``) and the
nftables table (``nft``, Debian ``nftables``) for the VMs of this agent, planned by
:mod:`impvm.agent.network.ruleset`.

Every attached VM has a record ``<state_dir>/<vm_id>.json`` (:class:`Attachment`). The table is
always rendered from all records and replaced in one transaction, so the records are the whole
truth and every step can be repeated:

* :meth:`NodeNetwork.attach`: record -> table -> interface. The interface never exists without
  its rules; a crash after the record leaves rules for an interface that does not exist yet
  (harmless), and the next attach of that VM continues where it stopped.
* :meth:`NodeNetwork.detach`: interface -> record -> table. A crash in between leaves rules for
  a name that no longer exists, removed by the next detach or start.
* :meth:`NodeNetwork.start` (agent start): reads the records (a record whose VM workdir is gone
  is stale and removed), deletes interfaces and namespaces named like ours that no record owns
  (a crash between creating one and recording it cannot happen, see attach, but another run's
  leftovers can), turns on IPv4 forwarding, and applies the table: the same rebuild whatever
  state the previous run died in.

Runs as root (CAP_NET_ADMIN); all methods are async and serialised by one lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from impvm.agent.network.plan import Attachment, Kind, NetConfig, create_commands, free_slot
from impvm.agent.network.policy import EgressLayer
from impvm.agent.network.ruleset import render
from impvm.agent.runtime import VMRequest, VMRuntimeError

log = logging.getLogger("impvm.agent.network")

NETNS_DIR = Path("/run/netns")
_IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


class NetworkError(VMRuntimeError):
    """A guest network could not be set up or removed (the message names the step)."""


@dataclass(frozen=True)
class GuestNetwork:
    """What a runtime needs to connect one VM: ``ifname`` (the tap device, or the node end of
    the veth pair), ``netns`` (``netns`` kind: the namespace to run the sandbox in), the guest's
    ``address``/``prefixlen``, its ``gateway``, and the ``dns`` resolvers it should use."""

    ifname: str
    netns: Path | None
    address: str
    prefixlen: int
    gateway: str
    dns: tuple[str, ...]


async def _run(what: str, *args: str, stdin: bytes | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin)
    text = (err or out).decode(errors="replace").strip()[-1000:]
    return proc.returncode or 0, text


async def _must(what: str, *args: str, stdin: bytes | None = None) -> None:
    rc, text = await _run(what, *args, stdin=stdin)
    if rc != 0:
        raise NetworkError(f"{what} failed (exit {rc}): {text}")


class NodeNetwork:
    """The guest networks of one agent (see module docstring). ``config``: names, subnet and
    resolvers; ``state_dir``: where the per-VM records and the last applied ruleset live."""

    def __init__(self, config: NetConfig, state_dir: Path) -> None:
        self.config = config
        self.state_dir = state_dir
        self._lock = asyncio.Lock()
        self._records: dict[str, Attachment] = {}
        self._loaded = False

    # ------------------------------------------------------------------ observe

    def _read_records(self) -> dict[str, Attachment]:
        out: dict[str, Attachment] = {}
        if not self.state_dir.is_dir():
            return out
        for f in sorted(self.state_dir.glob("*.json")):
            try:
                att = Attachment.from_json(f.read_text())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable network record %s: %s", f, exc)
                f.unlink(missing_ok=True)
                continue
            out[att.vm_id] = att
        return out

    async def interfaces(self) -> set[str]:
        """Names of this node's interfaces that look like ours (``<prefix>-<slot>``)."""
        proc = await asyncio.create_subprocess_exec(
            "ip",
            "-j",
            "link",
            "show",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise NetworkError(f"listing interfaces failed: {err.decode(errors='replace')}")
        links = json.loads(out or b"[]")
        return {
            str(link["ifname"])
            for link in links
            if self.config.slot_of(str(link.get("ifname", ""))) is not None
        }

    def namespaces(self) -> set[str]:
        """Names of network namespaces (``/run/netns``) that look like ours."""
        try:
            entries = os.listdir(NETNS_DIR)
        except OSError:
            return set()
        return {n for n in entries if self.config.slot_of(n) is not None}

    def attachments(self) -> list[Attachment]:
        """The VMs attached now (after :meth:`start`), ordered by slot."""
        return sorted(self._records.values(), key=lambda a: a.slot)

    def guest_network(self, att: Attachment) -> GuestNetwork:
        """The runtime's view of ``att``."""
        name = self.config.ifname(att.slot)
        return GuestNetwork(
            ifname=name,
            netns=NETNS_DIR / name if att.kind == "netns" else None,
            address=self.config.guest_address(att.slot),
            prefixlen=30,
            gateway=self.config.gateway(att.slot),
            dns=self.config.reachable_dns,
        )

    # ------------------------------------------------------------------ act

    def _write_record(self, att: Attachment) -> None:
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        dest = self.state_dir / f"{att.vm_id}.json"
        tmp = self.state_dir / f".{att.vm_id}.{uuid.uuid4().hex}"
        tmp.write_text(att.to_json())
        os.replace(tmp, dest)

    def _remove_record(self, vm_id: str) -> None:
        (self.state_dir / f"{vm_id}.json").unlink(missing_ok=True)

    def _write_ruleset(self, text: str) -> Path:
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.state_dir / "ruleset.nft"
        tmp = self.state_dir / f".ruleset.{uuid.uuid4().hex}"
        tmp.write_text(text)
        os.replace(tmp, path)
        return path

    async def _apply(self) -> None:
        """Replace the table with the rules for every record (one nft transaction)."""
        text = render(self.config, self._records.values())
        path = await asyncio.to_thread(self._write_ruleset, text)
        await _must(f"applying nftables table inet {self.config.table}", "nft", "-f", str(path))

    async def _remove_interface(self, name: str) -> None:
        if name in await self.interfaces():
            rc, text = await _run("", "ip", "link", "del", "dev", name)
            if rc != 0 and "Cannot find device" not in text:
                raise NetworkError(f"removing interface {name} failed: {text}")
        if (NETNS_DIR / name).exists():
            rc, text = await _run("", "ip", "netns", "del", name)
            if rc != 0 and (NETNS_DIR / name).exists():
                raise NetworkError(f"removing network namespace {name} failed: {text}")

    async def start(self) -> None:
        """Check the tools, turn on IPv4 forwarding, and rebuild from the records (see module
        docstring). Raises :class:`NetworkError` when a tool is missing or a step fails."""
        for tool, pkg in (("nft", "nftables"), ("ip", "iproute2")):
            if shutil.which(tool) is None:
                raise NetworkError(f"{tool} not found (Debian package {pkg})")
        async with self._lock:
            records = await asyncio.to_thread(self._read_records)
            for vm_id, att in list(records.items()):
                if not await asyncio.to_thread(os.path.exists, att.workdir):
                    log.info("removing the network of VM %s (its workdir is gone)", vm_id)
                    await self._remove_interface(self.config.ifname(att.slot))
                    await asyncio.to_thread(self._remove_record, vm_id)
                    del records[vm_id]
            self._records = records
            self._loaded = True
            owned = {self.config.ifname(a.slot) for a in records.values()}
            for name in sorted((await self.interfaces() | self.namespaces()) - owned):
                log.info("removing interface/namespace %s no VM owns", name)
                await self._remove_interface(name)
            await asyncio.to_thread(self._enable_forwarding)
            await self._apply()

    def _enable_forwarding(self) -> None:
        try:
            if _IP_FORWARD.read_text().strip() != "1":
                _IP_FORWARD.write_text("1\n")
                log.warning("turned on net.ipv4.ip_forward (guests are routed through the node)")
        except OSError as exc:
            raise NetworkError(f"cannot turn on net.ipv4.ip_forward: {exc}") from None

    async def set_protected(self, protected: tuple[str, ...]) -> bool:
        """Make ``protected`` (IPv4 CIDRs) the networks no guest reaches unless its policy
        names them (``NetConfig.protected``) and, once started, apply the table again when that
        changed anything. Returns whether it did. Raises :class:`NetworkError` (the table
        stays as it was) or ``NetConfigError`` for a bad network."""
        async with self._lock:
            new = replace(self.config, protected=protected)
            if new.protected == self.config.protected:
                return False
            old, self.config = self.config, new
            if self._loaded:
                try:
                    await self._apply()
                except NetworkError:
                    self.config = old
                    raise
            log.info("guests never reach (unless a policy names them): %s", new.protected)
            return True

    async def attach(
        self,
        *,
        vm_id: str,
        namespace: str,
        name: str,
        workdir: Path,
        layers: tuple[EgressLayer, ...],
        kind: Kind,
    ) -> GuestNetwork:
        """Give VM ``vm_id`` its own interface (``tap`` for QEMU, ``netns``: a namespace with a
        veth pair for a process sandbox) on a free slot, with its egress ``layers`` enforced
        before the interface exists. Idempotent for one VM (its slot is kept). Raises
        :class:`NetworkError` when no slot is free or a step fails (what was created is
        removed)."""
        async with self._lock:
            if not self._loaded:
                raise NetworkError("the node network was not started")
            old = self._records.get(vm_id)
            if old is not None and old.kind == kind:
                att = replace(old, layers=layers, namespace=namespace, name=name)
            else:
                if old is not None:
                    await self._remove_interface(self.config.ifname(old.slot))
                used = {a.slot for vid, a in self._records.items() if vid != vm_id}
                slot = free_slot(used, self.config.slots)
                if slot is None:
                    raise NetworkError(
                        f"no free address in guest subnet {self.config.subnet} "
                        f"({self.config.slots} VMs attached)"
                    )
                att = Attachment(vm_id, namespace, name, slot, kind, layers, str(workdir))
            await asyncio.to_thread(self._write_record, att)
            self._records[vm_id] = att
            dev = self.config.ifname(att.slot)
            try:
                await self._apply()
                if dev not in await self.interfaces() or (
                    kind == "netns" and not (NETNS_DIR / dev).exists()
                ):
                    await self._remove_interface(dev)
                    host, inner = create_commands(self.config, att)
                    await _must(
                        f"creating interface {dev}",
                        "ip",
                        "-batch",
                        "-",
                        stdin="\n".join(host).encode() + b"\n",
                    )
                    if inner:
                        await _must(
                            f"configuring namespace {dev}",
                            "ip",
                            "-n",
                            dev,
                            "-batch",
                            "-",
                            stdin="\n".join(inner).encode() + b"\n",
                        )
                    await asyncio.to_thread(_disable_ipv6, dev)
            except NetworkError:
                with contextlib.suppress(NetworkError):
                    await self._remove_interface(dev)
                self._records.pop(vm_id, None)
                await asyncio.to_thread(self._remove_record, vm_id)
                with contextlib.suppress(NetworkError):
                    await self._apply()
                raise
            return self.guest_network(att)

    async def attach_vm(self, req: VMRequest, kind: Kind) -> GuestNetwork:
        """:meth:`attach` for a runtime's request (its id, name, workdir and egress layers)."""
        return await self.attach(
            vm_id=req.vm_id,
            namespace=req.namespace,
            name=req.name,
            workdir=req.workdir,
            layers=req.egress,
            kind=kind,
        )

    async def detach(self, vm_id: str) -> None:
        """Remove VM ``vm_id``'s interface (and namespace), its record and its rules.
        Idempotent; a VM never attached is a no-op. Raises :class:`NetworkError`."""
        async with self._lock:
            att = self._records.get(vm_id)
            if att is None:
                return
            await self._remove_interface(self.config.ifname(att.slot))
            await asyncio.to_thread(self._remove_record, vm_id)
            del self._records[vm_id]
            await self._apply()

    async def teardown(self) -> None:
        """Detach every VM and delete the table (tests, the development stack)."""
        for att in self.attachments():
            await self.detach(att.vm_id)
        async with self._lock:
            rc, text = await _run("", "nft", "delete", "table", "inet", self.config.table)
            if rc != 0 and "No such file" not in text:
                raise NetworkError(f"deleting table inet {self.config.table} failed: {text}")


def parse_resolvers(text: str) -> list[str]:
    """The IPv4 ``nameserver`` addresses of a resolv.conf text that a guest can reach (loopback
    ones are the node's own stub and are left out)."""
    out: list[str] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                addr = ipaddress.IPv4Address(parts[1])
            except ValueError:
                continue
            if not addr.is_loopback and str(addr) not in out:
                out.append(str(addr))
    return out


def host_resolvers(
    paths: tuple[Path, ...] = (Path("/etc/resolv.conf"), Path("/run/systemd/resolve/resolv.conf")),
) -> list[str]:
    """The node's upstream resolvers for guests, as kubelet picks them for a pod with
    ``dnsPolicy: Default``: ``/etc/resolv.conf``, or - when that names only a loopback stub
    (systemd-resolved's 127.0.0.53) - systemd-resolved's upstream list. Empty when neither
    names one."""
    for p in paths:
        try:
            found = parse_resolvers(p.read_text())
        except OSError:
            continue
        if found:
            return found
    return []


def _disable_ipv6(dev: str) -> None:
    """No IPv6 on the node's end of a guest link (guests have no IPv6 egress; this also keeps
    the node from offering a link-local address on it)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6").write_text("1\n")


__all__ = ["GuestNetwork", "NetworkError", "NodeNetwork", "host_resolvers", "parse_resolvers"]
