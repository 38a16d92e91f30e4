"""The operator's HTTP endpoint (docs/architecture.md, fixed interfaces): ``GET /healthz``,
``GET /metrics`` (Prometheus text format),
``POST /webhooks/github`` and the agents' JIT config hand-out
(:mod:`impvm.operator.jithandout`).

Webhook bodies are bounded before anything else looks at them (:class:`BodyGate`), because the
same event loop renews the leader Lease:

- at most :data:`MAX_WEBHOOK_BODY_BYTES`. GitHub caps webhook payloads at 25 MB ("Webhook events
  and payloads", payload cap), but a ``workflow_job`` payload is the job (its steps, labels,
  runner), the repository, the organisation, the sender and the installation: the
  ``@octokit/webhooks-examples`` ``workflow_job`` payloads are 8 to 12 KiB, and a job with many
  steps adds about 150 bytes a step. 1 MiB is 80 times the largest example: room for jobs with
  thousands of steps and long names, and 25 times less memory per request than GitHub's cap;
- a ``Content-Length`` over it is answered 413 before a byte of the body is read, and a chunked
  body is counted while it streams in and refused the moment it passes the limit; the rest of a
  refused body is never read (the connection is closed after the answer);
- at most :data:`WEBHOOK_BODIES_AT_ONCE` bodies are read and verified at a time, with at most
  :data:`WEBHOOK_WAITING` more waiting (without their bodies being read); beyond that 503 with
  ``Retry-After``. Memory is then bounded whatever arrives: bodies at once x the limit, plus the
  socket buffers of the waiting requests.

Every answer, these included, is counted in ``impvm_webhook_requests_total`` by status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import Counter

from impvm.telemetry import metrics_http

WebhookHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Handler = WebhookHandler

#: The path GitHub delivers to.
WEBHOOK_PATH = "/webhooks/github"
#: The largest webhook body read (bytes; see the module docstring for the choice).
MAX_WEBHOOK_BODY_BYTES = 1024**2
#: Webhook bodies read and verified at once, and requests waiting for a turn.
WEBHOOK_BODIES_AT_ONCE = 4
WEBHOOK_WAITING = 64

WEBHOOK_RESULTS = Counter(
    "impvm_webhook_requests_total", "Webhook requests by HTTP status answered.", ["status"]
)
#: Where :class:`BodyGate` leaves the body it read for the handler.
BODY_KEY = web.RequestKey("impvm_webhook_body", bytes)


def answer(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON answer to a webhook request, counted in ``impvm_webhook_requests_total``."""
    WEBHOOK_RESULTS.labels(status=str(status)).inc()
    return web.json_response({"message": message}, status=status, headers=headers)


class BodyGate:
    """Bounds webhook bodies (see the module docstring): ``limit`` bytes each, ``at_once`` read
    at a time, ``waiting`` more queued. Use :meth:`middleware` in the application; the handler
    finds the body under :data:`BODY_KEY` (:func:`body_of`)."""

    def __init__(
        self,
        limit: int = MAX_WEBHOOK_BODY_BYTES,
        at_once: int = WEBHOOK_BODIES_AT_ONCE,
        waiting: int = WEBHOOK_WAITING,
    ) -> None:
        self.limit = limit
        self.waiting = waiting
        self._slots = asyncio.Semaphore(at_once)
        self._queued = 0

    def _too_large(self) -> web.Response:
        resp = answer(413, f"webhook body over {self.limit} bytes")
        resp.force_close()  # the rest of the body is never read
        return resp

    async def _read(self, request: web.Request) -> bytes | None:
        """The body, or None once more than ``limit`` bytes arrived."""
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.readany()
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != WEBHOOK_PATH or request.method != "POST":
            return await handler(request)
        length = request.content_length
        if length is not None and length > self.limit:
            return self._too_large()
        if self._queued >= self.waiting:
            return answer(503, "too many deliveries at once", {"Retry-After": "5"})
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1
        try:
            body = await self._read(request)
            if body is None:
                return self._too_large()
            request[BODY_KEY] = body
            return await handler(request)
        finally:
            self._slots.release()


async def body_of(request: web.Request) -> bytes:
    """The webhook body :class:`BodyGate` read (else read it now: an application without the
    gate)."""
    found = request.get(BODY_KEY)
    return found if found is not None else await request.read()


def _healthz(leading: Callable[[], bool]) -> Handler:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok leader\n" if leading() else "ok standby\n")

    return healthz


async def _no_webhooks(_: web.Request) -> web.Response:
    return answer(404, "webhook receiver not configured on this operator")


def make_app(
    webhook: WebhookHandler | None = None,
    jitconfig: Handler | None = None,
    leading: Callable[[], bool] | None = None,
    gate: BodyGate | None = None,
) -> web.Application:
    """The aiohttp application. ``webhook`` handles ``POST /webhooks/github`` behind ``gate``
    (a :class:`BodyGate` with the defaults when None); ``jitconfig`` the agents' ``GET`` of a
    VM's JIT config (:data:`impvm.operator.jithandout.PATH`).
    ``GET /healthz`` is 200 on every replica that runs, leader or standby (``leading``; the
    body says which): a standby is healthy and ready, because it forwards deliveries to the
    leader and serves the hand-out, and a rolling update needs the new replica Ready while the
    old one still leads. ``GET /metrics``: :mod:`impvm.telemetry.metrics_http`."""
    gate = gate or BodyGate()
    app = metrics_http.make_app(
        client_max_size=gate.limit, health=_healthz(leading or (lambda: True))
    )
    app.middlewares.append(gate.middleware)
    app.router.add_post(WEBHOOK_PATH, webhook or _no_webhooks)
    if jitconfig is not None:
        from impvm.operator.jithandout import PATH

        app.router.add_get(PATH, jitconfig)
    return app


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; return the runner (``await runner.cleanup()`` to stop).
    A request body the handler did not read is not read afterwards either (no lingering: the
    connection is closed). Raises ``OSError`` when the address cannot be bound."""
    runner = web.AppRunner(app, access_log=None, lingering_time=0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
