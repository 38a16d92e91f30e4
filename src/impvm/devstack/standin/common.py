"""What every route of the GitHub stand-in's HTTP server shares: the app keys, errors in
GitHub's shape, the caller of a request, the org or repository a route names, pagination."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from impvm.devstack.standin.records import TokenRec
from impvm.devstack.standin.state import StandInState

DOCS = "https://docs.github.com/rest"
API_PREFIXES = ("", "/api/v3")
STATE_KEY = web.AppKey("state", StandInState)
TASKS_KEY: web.AppKey[set[asyncio.Task[None]]] = web.AppKey("tasks")


class ApiError(Exception):
    """An error answered in GitHub's shape ``{"message", "documentation_url", "status"}``."""

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, doc: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.doc = doc or DOCS


def error_response(err: ApiError) -> web.Response:
    body = {"message": err.message, "documentation_url": err.doc, "status": str(err.status)}
    return web.json_response(body, status=err.status, headers=err.headers)


@dataclass
class Caller:
    """Who made a request: ``kind`` is ``app`` (JWT), ``installation``, ``pat`` or ``anon``."""

    kind: str
    identity: str
    app_id: int | None = None
    token: TokenRec | None = None


CALLER_KEY = web.RequestKey("caller", Caller)


def state_of(request: web.Request) -> StandInState:
    return request.app[STATE_KEY]


def org_of(request: web.Request) -> str:
    org = request.match_info["org"]
    if org not in state_of(request).orgs:
        raise ApiError(404, "Not Found")
    return org


def repo_of(request: web.Request) -> str:
    full = f"{request.match_info['owner']}/{request.match_info['repo']}"
    if full not in state_of(request).repos:
        raise ApiError(404, "Not Found")
    return full


def _page(request: web.Request) -> tuple[int, int]:
    try:
        per_page = min(max(int(request.query.get("per_page", "30")), 1), 100)
        page = max(int(request.query.get("page", "1")), 1)
    except ValueError:
        raise ApiError(422, "Invalid pagination parameters") from None
    return per_page, page


def paged(
    request: web.Request, items: list[dict[str, Any]], key: str, extra: dict[str, Any] | None = None
) -> web.Response:
    per_page, page = _page(request)
    chunk = items[(page - 1) * per_page : page * per_page]
    headers = {}
    last = max((len(items) + per_page - 1) // per_page, 1)
    if page < last:
        url = request.url.update_query(page=str(page + 1), per_page=str(per_page))
        headers["Link"] = f'<{url}>; rel="next", <{request.url.update_query(page=str(last))}>; '
        headers["Link"] += 'rel="last"'
    body = {"total_count": len(items), key: chunk, **(extra or {})}
    return web.json_response(body, headers=headers)
