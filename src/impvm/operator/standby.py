"""What a standby replica does with a webhook delivery: it forwards it to the leader.

Only the leader keeps the job table the pool passes read, so a delivery that reaches a standby
(a Service in front of the replicas sends it to any Ready one, and standbys are Ready) is sent
on, unchanged (body and the GitHub headers the
receiver checks), to the URL the leader wrote on the Lease. GitHub does not redeliver a failed
delivery by itself ("Handling failed webhook deliveries" in the GitHub docs), so answering 503
would lose it until the next safety poll: forwarding is the first choice, 503 the last (no
leader known after waiting a few seconds for the replica's first read of the Lease, the
leader unreachable, or a delivery that was already forwarded once and again
reached a non-leader, which breaks forwarding loops).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
from aiohttp import web

from impvm.operator.http import body_of

log = logging.getLogger("impvm.operator.standby")

#: Marks a forwarded delivery (a forwarded one is never forwarded again).
FORWARDED_HEADER = "X-Impvm-Forwarded"
#: The request headers the receiver reads (GitHub's delivery headers).
KEPT_HEADERS = (
    "Content-Type",
    "X-GitHub-Event",
    "X-GitHub-Delivery",
    "X-Hub-Signature-256",
    "X-GitHub-Hook-ID",
    "User-Agent",
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class LeaderGate:
    """Wraps the webhook receiver: the leader handles a delivery itself, a standby forwards it
    to ``leader_url()`` (its ``/webhooks/github``). ``leading``: the fencing check.
    ``settle(seconds)``: waits until this replica leads or knows the leader (a replica that has
    not read the Lease yet, just started, waits up to ``settle_seconds`` before refusing)."""

    def __init__(
        self,
        handler: Handler,
        leading: Callable[[], bool],
        leader_url: Callable[[], str],
        timeout: float = 10.0,
        settle: Callable[[float], Awaitable[None]] | None = None,
        settle_seconds: float = 5.0,
    ) -> None:
        self.handler = handler
        self.leading = leading
        self.leader_url = leader_url
        self.settle = settle
        self.settle_seconds = settle_seconds
        self._http = httpx.AsyncClient(timeout=timeout)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        forwarded = bool(request.headers.get(FORWARDED_HEADER))
        if not self.leading() and not self.leader_url() and not forwarded and self.settle:
            await self.settle(self.settle_seconds)
        if self.leading():
            return await self.handler(request)
        url = self.leader_url()
        if not url or forwarded:
            return _unavailable("no leader to take the delivery; GitHub may redeliver it")
        body = await body_of(request)  # bounded by the HTTP endpoint's gate
        headers = {h: v for h in KEPT_HEADERS if (v := request.headers.get(h)) is not None}
        headers[FORWARDED_HEADER] = "1"
        try:
            resp = await self._http.post(
                url.rstrip("/") + "/webhooks/github", content=body, headers=headers
            )
        except httpx.HTTPError as e:
            log.warning("forwarding a delivery to the leader failed: %s", type(e).__name__)
            return _unavailable("the leader is unreachable; GitHub may redeliver it")
        return web.Response(
            body=resp.content,
            status=resp.status_code,
            content_type=resp.headers.get("Content-Type", "application/json").split(";")[0],
        )

    async def close(self) -> None:
        await self._http.aclose()


def _unavailable(message: str) -> web.Response:
    return web.json_response({"message": message}, status=503, headers={"Retry-After": "5"})
