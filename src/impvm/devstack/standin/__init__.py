"""The GitHub stand-in: a real HTTP server that behaves like GitHub for what impvm calls.

In process (tests)::

    standin = StandIn()
    await standin.start()            # binds 127.0.0.1 on a free port
    standin.state.add_app(APP_ID, private_key_pem)          # public part is used
    standin.state.add_installation(INST_ID, APP_ID, "octo-org",
                                   {"organization_self_hosted_runners": "write"})
    standin.state.add_repo("octo-org/app")
    ... GitHubClient(creds, api_url=standin.url) ...
    await standin.stop()

Out of process: ``impvm github-standin --host H --port P`` (:func:`serve`), then seed with
``POST /_standin/seed`` (see :mod:`impvm.devstack.standin.server` for the control API).
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from impvm.devstack.standin.records import JobRec, WebhookTarget
from impvm.devstack.standin.server import build_app
from impvm.devstack.standin.state import StandInState
from impvm.devstack.standin.webhooks import emit_workflow_job

__all__ = ["StandIn", "StandInState", "serve"]


class StandIn:
    """An in-process stand-in on ``host``:``port`` (0 = a free port), or on the listening
    ``sock`` when given (e.g. one made inside another network namespace). ``url`` is the API base
    (``http://host:port``; ``url + "/api/v3"`` serves the same API GHES-style)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None
    ) -> None:
        self.sock = sock
        if sock is not None:
            host, port = sock.getsockname()[:2]
        self.host = host
        self.port = port
        self.state = StandInState()
        self._runner: web.AppRunner | None = None
        self._app: web.Application | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        if self._runner is None:
            raise RuntimeError("stand-in not started")
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve. Raises ``OSError`` if the port is taken."""
        self._app = build_app(self.state)
        runner = web.AppRunner(self._app, access_log=None)
        await runner.setup()
        site: web.BaseSite = (
            web.SockSite(runner, self.sock)
            if self.sock is not None
            else web.TCPSite(runner, self.host, self.port)
        )
        await site.start()
        if self.port == 0:
            self.port = int(runner.addresses[0][1])
        self._runner = runner
        self.state.base_url = self.url

    def queue_job(
        self, repo: str, labels: list[str], *, name: str = "build", sleep_seconds: float = 0.0
    ) -> JobRec:
        """Queue a job (like ``POST /_standin/jobs``) and deliver its ``queued`` webhook to
        every registered target. Call from the stand-in's event loop."""
        job = self.state.queue_job(repo, labels, name=name, sleep_seconds=sleep_seconds)
        if self._app is not None:
            emit_workflow_job(self._app, "queued", job)
        return job

    def add_webhook(
        self, url: str, secret: str, drop_rate: float = 0.0, app_id: int | None = None
    ) -> None:
        """Deliver signed ``workflow_job`` webhooks to ``url`` (losing ``drop_rate`` of them):
        the events of ``app_id``'s installations only, when given (an App's webhook)."""
        self.state.webhooks.append(WebhookTarget(url, secret, drop_rate, app_id))

    async def stop(self) -> None:
        """Stop serving. Idempotent."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> StandIn:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def serve(host: str, port: int) -> None:
    """Serve the stand-in until interrupted (blocking). Used by ``impvm github-standin``."""

    async def _main() -> None:
        standin = StandIn(host, port)
        await standin.start()
        print(f"GitHub stand-in listening on {standin.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await standin.stop()

    try:
        asyncio.run(_main())
    except KeyboardInterrupt:
        pass
