"""The network tests' world, all made by the tests themselves and removed afterwards:

* a guest subnet, nftables table and interface prefix of this run (``NetConfig``) and a
  :class:`NodeNetwork` on them (the node side lives in the host's namespace, as in production);
* "internet" (:class:`NetNamespace`): HTTP on two addresses (``a`` on ports 80 and 8080, ``b`` on
  80), the probe control server (``a``:8000) and dnsmasq (``dns``) answering ``github.test``;
* "metadata": 169.254.169.254:80, and "lan": a private address (172.31.254.2:80) - test hosts
  the host's own routing never sees (:class:`GuestRoutes` routes only guest traffic to them and
  blackholes everything else, so no guest packet leaves this machine);
* a host service on every host address (0.0.0.0) and, in the QEMU tests, a kube-apiserver bound
  to every host address (kube-apiserver's default): what a guest must not reach.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from impvm.agent.network.node import NodeNetwork
from impvm.agent.network.plan import NetConfig
from impvm.devstack.netns import (
    GUEST_RANGES,
    INTERNET_RANGES,
    GuestRoutes,
    NetNamespace,
    pick_subnet,
    run_token,
)
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.testimages import build_base_image, build_runner_layer_image

from .probe import PROBE_AGENT_SH, ProbeControl

if os.geteuid() != 0:  # interfaces, namespaces and nftables need CAP_NET_ADMIN (CI runs as root)
    pytest.fail("network tests need root", pytrace=False)
for _tool in ("nft", "ip", "dnsmasq", "busybox", "nsenter"):
    if shutil.which(_tool) is None:  # scripts/setup.sh installs these
        pytest.fail(f"network tests need {_tool} (scripts/setup.sh installs it)", pytrace=False)


@dataclass
class World:
    token: str
    config: NetConfig
    internet: NetNamespace
    metadata: NetNamespace
    lan: NetNamespace
    routes: GuestRoutes
    a: str  # internet address a (HTTP 80, 8080; probe control 8000)
    b: str  # internet address b (HTTP 80)
    dns: str  # dnsmasq in the internet namespace
    host_service_port: int  # HTTP on 0.0.0.0 of the host
    control: ProbeControl

    def nft_table(self) -> dict[str, object]:
        """``nft -j list table`` of this run's table, as {chains, rules, map elements}."""
        out = subprocess.run(
            ["nft", "-j", "list", "table", "inet", self.config.table],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        items = json.loads(out)["nftables"]
        chains = [i["chain"]["name"] for i in items if "chain" in i]
        rules = [i["rule"] for i in items if "rule" in i]
        maps = [i["map"] for i in items if "map" in i]
        return {"chains": chains, "rules": rules, "map_elements": maps[0].get("elem", [])}

    def links(self) -> list[str]:
        """This run's guest interfaces and per-VM namespaces that exist on the host."""
        links = json.loads(
            subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout
        )
        names = [lk["ifname"] for lk in links if self.config.slot_of(lk["ifname"]) is not None]
        ns = [n for n in Path("/run/netns").iterdir() if self.config.slot_of(n.name) is not None]
        return names + [f"netns:{n.name}" for n in ns]


def _http_app(body: str) -> web.Application:
    async def handle(_req: web.Request) -> web.Response:
        return web.Response(text=f"{body}\n")

    app = web.Application()
    app.router.add_get("/", handle)
    return app


async def _serve(runners: list[web.AppRunner], body: str, sock: socket.socket) -> None:
    r = web.AppRunner(_http_app(body), access_log=None)
    await r.setup()
    await web.SockSite(r, sock).start()
    runners.append(r)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    token = run_token()
    config = NetConfig(
        table=f"ivt{token}",
        ifprefix=f"iv{token}",
        subnet=pick_subnet(GUEST_RANGES, 24),
    )
    inet = ipaddress.IPv4Network(pick_subnet(INTERNET_RANGES, 29))
    a, b, dns = (str(inet.network_address + i) for i in (1, 2, 3))
    made: list[NetNamespace] = []
    runners: list[web.AppRunner] = []
    routes = None
    dnsmasq = None
    control = None
    try:
        internet = NetNamespace(
            f"impvm-inet-{token}",
            f"ivi{token}",
            str(inet),
            str(inet.network_address + 6),
            [a, b, dns],
        ).create()
        made.append(internet)
        metadata = NetNamespace(
            f"impvm-md-{token}", f"ivm{token}", "169.254.169.252/30", "169.254.169.253",
            ["169.254.169.254"], host_route=False,
        ).create()  # fmt: skip
        made.append(metadata)
        lan = NetNamespace(
            f"impvm-lan-{token}", f"ivl{token}", "172.31.254.0/30", "172.31.254.1",
            ["172.31.254.2"], host_route=False,
        ).create()  # fmt: skip
        made.append(lan)
        routes = GuestRoutes(config.subnet, 20000 + int(token, 16) % 40000, made).create()
        await _serve(runners, "internet-a", internet.socket(a, 80))
        await _serve(runners, "internet-a-8080", internet.socket(a, 8080))
        await _serve(runners, "internet-b", internet.socket(b, 80))
        await _serve(runners, "metadata", metadata.socket("169.254.169.254", 80))
        await _serve(runners, "lan", lan.socket("172.31.254.2", 80))
        host_sock = socket.socket()
        host_sock.bind(("0.0.0.0", 0))  # the point: a service on every host address
        host_sock.listen(16)
        await _serve(runners, "host-service", host_sock)
        control = ProbeControl(internet.socket(a, 8000))
        await control.start()
        dnsmasq = await asyncio.create_subprocess_exec(
            *internet.exec_args(
                "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                "--no-hosts", "--bind-interfaces", f"--listen-address={dns}", "--user=root",
                "--pid-file=", f"--address=/github.test/{a}",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        yield World(
            token=token,
            config=NetConfig(config.table, config.ifprefix, config.subnet, (dns,)),
            internet=internet,
            metadata=metadata,
            lan=lan,
            routes=routes,
            a=a,
            b=b,
            dns=dns,
            host_service_port=host_sock.getsockname()[1],
            control=control,
        )
    finally:
        if dnsmasq is not None:
            dnsmasq.terminate()
            await dnsmasq.wait()
        if control is not None:
            await control.stop()
        for r in runners:
            await r.cleanup()
        if routes is not None:
            routes.delete()
        for ns in made:
            ns.delete()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def node_network(
    world: World, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[NodeNetwork]:
    """This run's node network, started; torn down (interfaces, namespaces, table) at the end."""
    nn = NodeNetwork(world.config, tmp_path_factory.mktemp("node-network"))
    await nn.start()
    try:
        yield nn
    finally:
        await nn.teardown()


def policy_off(world: World, ifname: str, slot: int) -> None:
    """Let everything from ``ifname`` through (first rule of its chain, of ``forward`` and of
    ``input``): the probe of a negative test must succeed like this, or the test could not fail.
    Undone by the next table change (``NodeNetwork.start()`` rebuilds it)."""
    t = world.config.table
    accept = f'iifname "{ifname}" accept'
    for chain, rule in ((f"vm-{slot}", "accept"), ("forward", accept), ("input", accept)):
        subprocess.run(["nft", "insert", "rule", "inet", t, chain, *rule.split()], check=True)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (ip, nft) to arrange or inspect the host."""
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=60)


def kernel_log() -> str:
    return subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def tmp_workdir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


async def eventually(check: object, seconds: float = 10.0) -> None:
    """Poll the callable ``check`` until it returns truthy (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


#: ``nc -e`` program: send the request, copy the answer to stderr (busybox nc quits at stdin's
#: end, before an asynchronous server has answered, so the request cannot come from stdin)
REQUEST_SH = "#!/bin/sh\nprintf 'GET / HTTP/1.0\\r\\n\\r\\n'\ncat >&2\n"


@functools.cache
def _request_script() -> Path:
    fd, name = tempfile.mkstemp(prefix="impvm-probe-", suffix=".sh")
    os.write(fd, REQUEST_SH.encode())
    os.close(fd)
    os.chmod(name, 0o755)
    atexit.register(os.unlink, name)
    return Path(name)


async def nc_probe(netns: str, host: str, port: int, seconds: float = 3) -> str | None:
    """From inside namespace ``netns``: send ``GET / HTTP/1.0`` to ``host``:``port``; the last
    line of an HTTP answer, or ``None`` when none came (refused, rejected, timed out)."""
    req = _request_script()
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", netns, "busybox", "timeout", str(int(seconds) + 2),
        "busybox", "nc", "-w", str(int(seconds)), host, str(port), "-e", str(req),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    text = err.decode(errors="replace")
    if "HTTP/1" not in text:
        return None
    return text.strip().splitlines()[-1]


#: what a connect from a guest namespace ends in, by errno (Python's own socket errors)
CONNECT_SH = r"""
import errno, socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except TimeoutError:
    print("timeout")
except OSError as e:
    print({errno.EHOSTUNREACH: "unreachable", errno.ECONNREFUSED: "refused"}.get(e.errno, str(e)))
"""


async def connect_error(netns: str, host: str, port: int, seconds: float = 30) -> str:
    """From inside ``netns``: how a TCP connect to ``host``:``port`` ends - ``connected``,
    ``unreachable`` (an ICMP unreachable/prohibited came back), ``refused`` (a TCP reset), or
    ``timeout`` (nothing came back within ``seconds``: the packet was dropped). A kind, never a
    duration: what a job sees, without a timed assert."""
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", netns, sys.executable, "-c", CONNECT_SH, host, str(port),
        str(seconds),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    return out.decode().strip() or err.decode(errors="replace").strip()[-300:]


async def dns_probe(netns: str, name: str, server: str) -> str | None:
    """From inside ``netns``: the address ``server`` gives for ``name``, or ``None``."""
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", netns, "busybox", "nslookup", name, server,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await proc.communicate()
    addrs = [
        ln.split(":", 1)[1].strip()
        for ln in out.decode().splitlines()[2:]
        if ln.startswith("Address")
    ]
    return addrs[-1] if addrs else None


# -------------------------------------------------------------------------------- guests


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def probe_images(
    registry: LocalRegistry,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, str]:
    """(base image, probe agent runner layer), pinned by digest."""
    work = tmp_path_factory.mktemp("probe-images")
    base = await build_base_image(work / "base", registry.address)
    layer = await build_runner_layer_image(
        work / "probe", registry.address, run_sh=PROBE_AGENT_SH, tag="probe-agent"
    )
    return base, layer
