"""``impvm up --config impvm.yaml``: run :class:`~impvm.up.service.Service` in the foreground
until SIGTERM or SIGINT (systemd's stop, Ctrl-C), restarting a component that dies.

Exit codes: 0 after a stop signal, 1 when the service could not start, 2 for a configuration
error (one line on stderr naming the field), 130 when interrupted while starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from impvm.agent.network import UNISOLATED, UNISOLATED_WARNING
from impvm.up.config import ConfigError
from impvm.up.loader import load_config
from impvm.up.service import Service

#: called once a second while the service runs; returns an exit code to stop with, or None
Tick = Callable[[Service], Awaitable[int | None]]
Say = Callable[[str], None]


def _say(line: str) -> None:
    print(line, flush=True)


async def serve(
    make: Callable[[], Awaitable[Service]],
    *,
    restart_crashed: bool = True,
    tick: Tick | None = None,
    say: Say = _say,
    start_agent: bool = True,
    interrupted_code: int = 0,
    keep_vms: bool = False,
) -> int:
    """Make the service (``make``: e.g. after starting what a development configuration points
    at), start it, supervise it until a stop signal (or ``tick`` returns a code), stop it;
    return the exit code. ``restart_crashed``: restart a dead component with backoff (a
    service), or stop with code 1 naming it (a smoke test that must show crashes).
    ``interrupted_code``: returned when a signal stops the running service. ``keep_vms``: leave
    running VMs to the next start's agent when a signal stops the running service (see
    :meth:`Service.stop`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before starting: a stop during start-up works
        loop.add_signal_handler(sig, stop.set)
    try:
        code = await _serve(make, stop, restart_crashed, tick, say, start_agent, keep_vms)
        return interrupted_code if code is None else code
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve(
    make: Callable[[], Awaitable[Service]],
    stop: asyncio.Event,
    restart_crashed: bool,
    tick: Tick | None,
    say: Say,
    start_agent: bool,
    keep_vms: bool = False,
) -> int | None:
    """Like :func:`serve`; ``None`` when a signal stopped the running service."""
    made: list[Service] = []

    async def starting_up() -> None:
        made.append(await make())
        await made[0].start(start_agent=start_agent)

    async def stop_made() -> None:
        if made:
            await made[0].stop()

    starting = asyncio.create_task(starting_up())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        say("impvm: interrupted while starting; stopping")
        await stop_made()
        return 130
    stopping.cancel()
    exc = starting.exception()
    if exc is not None:
        await stop_made()
        if isinstance(exc, ConfigError):
            print(str(exc), file=sys.stderr, flush=True)
            return 2
        say(f"impvm: did not start: {type(exc).__name__}: {exc}")
        return 1
    service = made[0]
    say(
        f"impvm up: control plane {service.control_plane.url if service.control_plane else ''}"
        f", data in {service.data_dir}\n"
        f"  export KUBECONFIG={service.kubeconfig}\n"
        f"  operator http://{service.config.operator.listen}"
        " (POST /webhooks/github, GET /metrics, GET /healthz)"
        f", agent node {service.node_name} (runtime {service.config.agent.runtime})"
    )
    if service.config.agent.guest_network == UNISOLATED:
        say(f"impvm: WARNING: agent.guestNetwork unisolated: {UNISOLATED_WARNING}")
    code: int | None = None
    try:
        while not stop.is_set():
            try:
                for line in service.supervise(restart=restart_crashed):
                    say(f"impvm: {line}")
            except RuntimeError as e:
                say(f"impvm: {e}")
                code = 1
                break
            if tick is not None:
                got = await tick(service)
                if got is not None:
                    code = got
                    break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        say("impvm: stopping")
        # a stop signal (systemd's stop or restart, an upgrade) leaves the VMs' jobs running
        await service.stop(keep_vms=keep_vms and stop.is_set() and code is None)
    return code


def run(config_path: Path) -> int:
    """``impvm up``: load the configuration (a problem: one line on stderr, exit 2) and serve."""
    try:
        config = load_config(config_path)
    except ConfigError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 2

    async def make() -> Service:
        return Service(config, source=str(config_path))

    return asyncio.run(serve(make, keep_vms=True))
