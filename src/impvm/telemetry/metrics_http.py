"""The Prometheus endpoint both processes serve: ``GET /metrics`` (text exposition format of
the default registry) and ``GET /healthz``, on aiohttp. The operator adds its webhook route to
the same application; the agent serves only these two."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


async def healthz(_: web.Request) -> web.Response:
    """``ok`` while the event loop answers."""
    return web.Response(text="ok\n")


async def metrics(_: web.Request) -> web.Response:
    """Every metric of this process (names start with ``impvm_``, plus the client library's
    process and Python collectors)."""
    body = generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(
    client_max_size: int = 1024**2,
    health: Callable[[web.Request], Awaitable[web.StreamResponse]] = healthz,
) -> web.Application:
    """An application with ``/metrics`` and ``/healthz`` (answered by ``health``);
    ``client_max_size`` caps request bodies (bytes)."""
    app = web.Application(client_max_size=client_max_size)
    app.router.add_get("/healthz", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; return the runner (``await runner.cleanup()`` to stop).
    Raises ``OSError`` when the address cannot be bound."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 hosts in brackets) -> ``(host, port)``; raises ``ValueError`` naming
    what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: want HOST:PORT")
    return host.strip("[]"), int(port)
