"""The GitHub stand-in's middleware for its GitHub-shaped routes: auth, injected failures,
rate-limit accounting, ETags and the request log."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from impvm.devstack.standin.auth import caller_of
from impvm.devstack.standin.common import (
    API_PREFIXES,
    CALLER_KEY,
    ApiError,
    error_response,
    state_of,
)
from impvm.devstack.standin.limits import (
    bucket_for,
    injected_response,
    matching_failure,
    rate_headers,
)
from impvm.devstack.standin.records import RateBucket


def _template(request: web.Request) -> str:
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else request.path
    for prefix in API_PREFIXES[1:]:
        if path.startswith(prefix + "/"):
            return path[len(prefix) :]
    return path


@web.middleware
async def github_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Auth, injected failures, rate-limit accounting, ETags and the request log for the
    GitHub-shaped routes; control routes pass straight through."""
    state = state_of(request)
    if request.path.startswith("/_standin"):
        return await handler(request)
    path = _template(request)
    entry: dict[str, Any] = {
        "method": request.method,
        "path": path,
        "url": request.path,
        "time": time.time(),
        "conditional": "If-None-Match" in request.headers,
    }
    state.requests.append(entry)
    bucket: RateBucket | None = None
    try:
        caller = caller_of(state, request)
        request[CALLER_KEY] = caller
        entry["identity"] = caller.identity
        failure = matching_failure(state, request.method, path)
        if failure is not None:
            entry["injected"] = failure.kind
            injected = await injected_response(failure, state, caller)
            if injected is not None:
                entry["status"] = injected.status
                return injected
        counted = path != "/rate_limit"
        if counted:
            bucket = bucket_for(state, caller.identity)
            if bucket.remaining <= 0:
                raise ApiError(
                    403,
                    f"API rate limit exceeded for {caller.identity}.",
                    rate_headers(bucket),
                    "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api",
                )
        response = await handler(request)
    except ApiError as err:
        response = error_response(err)
    assert isinstance(response, web.Response)
    if request.method == "GET" and response.status == 200 and isinstance(response.body, bytes):
        etag = 'W/"' + hashlib.sha256(response.body).hexdigest() + '"'
        response.headers["ETag"] = etag
        if etag in [t.strip() for t in request.headers.get("If-None-Match", "").split(",")]:
            # A 304 does not count against the primary rate limit (GitHub REST best practices).
            not_modified = web.Response(status=304, headers={"ETag": etag})
            if bucket is not None:
                not_modified.headers.update(rate_headers(bucket))
            entry["status"] = 304
            return not_modified
    if bucket is not None and response.status < 500 and not response.headers.get("retry-after"):
        if not (response.status == 403 and bucket.remaining <= 0):
            bucket.remaining = max(bucket.remaining - 1, 0)
        response.headers.update(rate_headers(bucket))
    response.headers.setdefault("X-GitHub-Request-Id", uuid.uuid4().hex[:20].upper())
    entry["status"] = response.status
    return response
