"""The probe agent: a runner layer whose ``run.sh`` (busybox sh) asks a control server in the test
"internet" namespace what to do next, does it, and reports the result - so one booted guest (or
process sandbox) answers many reachability questions. The control server's address arrives as
the JIT config (``HOST PORT NAME``), the one value a test may hand a guest at launch.

Commands (one line, the server's answer to ``GET /next?vm=NAME&n=N``):
``tcp HOST PORT`` (send ``GET / HTTP/1.0``, report ``ok:<last line of the answer>`` or ``fail``),
``dns NAME [SERVER]`` (``ok:<address>`` or ``fail``), ``resolvers`` (``ok:`` and the
nameservers of the guest's /etc/resolv.conf, each followed by ``_``), ``connect HOST PORT`` (how a TCP connect ends:
``connected``, ``unreachable``, ``refused`` or ``other:<nc's message>``, e.g. its timeout), ``serve PORT`` (busybox httpd answering
``guest-NAME``), ``echo`` (``ok``), ``wait`` (ask again shortly), ``exit CODE``. Results come back as
``GET /result?vm=NAME&n=N&r=RESULT``.
"""

from __future__ import annotations

import asyncio
import socket
from collections import defaultdict
from pathlib import Path

from aiohttp import web

from impvm.agent.network.policy import EgressLayer
from impvm.agent.runtime import VMRequest

PROBE_AGENT_SH = r"""#!/bin/sh
set -- $ACTIONS_RUNNER_INPUT_JITCONFIG
ctl_host=$1 ctl_port=$2 me=$3
# busybox nc quits at its stdin's end, before the server answers: send from an -e program
printf '#!/bin/sh\nprintf "GET %%s HTTP/1.0\\r\\n\\r\\n" "$REQ"\ncat >&2\n' >/tmp/req
chmod +x /tmp/req
get() { REQ=$3 timeout 8 nc -w 3 "$1" "$2" -e /tmp/req 2>&1 >/dev/null; }
ask() { get "$ctl_host" "$ctl_port" "$1" | tail -n 1; }
clean() { tr -dc 'A-Za-z0-9.:_-' | cut -c1-80; }
mkdir -p /tmp/www
echo "guest-$me" >/tmp/www/index.html
echo "probe agent $me up"
n=0
while :; do
    cmd=$(ask "/next?vm=$me&n=$n")
    set -- $cmd
    case "$1" in
    tcp)
        out=$(get "$2" "$3" /)
        if echo "$out" | grep -q 'HTTP/1'; then r="ok:$(echo "$out" | tail -n 1 | clean)"; else r=fail; fi
        ;;
    dns)
        # the answer's addresses follow its Name: line (the server's own come before)
        out=$(nslookup "$2" $3 2>/dev/null | sed -n '/^Name:/,$s/^Address:[[:space:]]*//p' | tail -n 1 | clean)
        if [ -n "$out" ]; then r="ok:$out"; else r=fail; fi
        ;;
    resolvers)
        r="ok:$(sed -n 's/^nameserver[[:space:]]*//p' /etc/resolv.conf | tr '\n' '_' | clean)"
        ;;
    connect)
        # how a connect ends: at once with an ICMP error or a reset, or by nc's 30 s timeout
        out=$(timeout 40 nc -w 30 "$2" "$3" </dev/null 2>&1)
        rc=$?
        case "$out" in
        *"No route to host"*) r=unreachable ;;
        *refused*) r=refused ;;
        *) if [ "$rc" -eq 0 ]; then r=connected; else r="other:$(echo "$out" | clean)"; fi ;;
        esac
        ;;
    echo) r=ok ;;
    serve)
        httpd -p "$2" -h /tmp/www && r=ok || r=fail
        ;;
    exit)
        exit "$2"
        ;;
    *)
        sleep 0.3
        continue
        ;;
    esac
    echo "probe $n: $cmd -> $r"
    ask "/result?vm=$me&n=$n&r=$r" >/dev/null
    n=$((n + 1))
done
"""


class ProbeControl:
    """The control server (aiohttp on a socket made in the test internet namespace)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.host, self.port = sock.getsockname()[:2]
        self.commands: dict[str, list[str]] = defaultdict(list)
        self.results: dict[str, dict[int, str]] = defaultdict(dict)
        self._changed = asyncio.Event()
        self._runner: web.AppRunner | None = None

    def jit(self, vm: str) -> str:
        """The value to hand guest ``vm`` as its JIT config."""
        return f"{self.host} {self.port} {vm}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/next", self._next)
        app.router.add_get("/result", self._result)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, self.sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _next(self, request: web.Request) -> web.Response:
        vm, n = request.query["vm"], int(request.query["n"])
        cmds = self.commands[vm]
        return web.Response(text=(cmds[n] if n < len(cmds) else "wait") + "\n")

    async def _result(self, request: web.Request) -> web.Response:
        self.results[request.query["vm"]][int(request.query["n"])] = request.query["r"]
        self._changed.set()
        return web.Response(text="thanks\n")

    async def run(self, vm: str, *cmds: str, seconds: float = 240) -> list[str]:
        """Queue ``cmds`` for guest ``vm`` and return their results, in order."""
        first = len(self.commands[vm])
        self.commands[vm].extend(cmds)
        want = range(first, first + len(cmds))
        async with asyncio.timeout(seconds):
            while not all(n in self.results[vm] for n in want):
                self._changed.clear()
                await self._changed.wait()
        return [self.results[vm][n] for n in want]

    async def up(self, vm: str, seconds: float = 240) -> None:
        """Wait until guest ``vm`` answers."""
        await self.run(vm, "echo", seconds=seconds)


def probe_request(
    root: Path, name: str, images: tuple[str, str], layers: tuple[EgressLayer, ...] = ()
) -> VMRequest:
    """A runtime's request for probe VM ``name`` (workdir under ``root``) from ``images``
    (base image, probe runner layer), behind egress ``layers``."""
    return VMRequest(
        vm_id=f"t.{name}.0000",
        name=name,
        namespace="t",
        image=images[0],
        runner_layer=images[1],
        allow_unpinned_images=False,
        vcpu=1,
        memory_mib=256,
        disk_gib=1,
        workdir=root / name,
        egress=layers,
    )
