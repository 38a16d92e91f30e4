"""The GitHub stand-in's rate limits and injected failures: the primary rate-limit bucket per
caller identity and its headers, the failures of ``POST /_standin/failures`` and the responses
they make, and ``GET /rate_limit``."""

from __future__ import annotations

import asyncio
import random
import time

from aiohttp import web

from impvm.devstack.standin.common import CALLER_KEY, ApiError, Caller, error_response, state_of
from impvm.devstack.standin.records import Failure, RateBucket
from impvm.devstack.standin.state import StandInState


def matching_failure(state: StandInState, method: str, path: str) -> Failure | None:
    for failure in state.failures:
        if failure.count <= 0:
            continue
        if failure.method and failure.method.upper() != method:
            continue
        if failure.path and failure.path != path:
            continue
        if failure.probability < 1.0 and random.random() >= failure.probability:
            continue
        failure.count -= 1
        return failure
    return None


def bucket_for(state: StandInState, identity: str) -> RateBucket:
    bucket = state.buckets.setdefault(identity, RateBucket(reset=time.time() + 3600))
    if time.time() >= bucket.reset:
        bucket.remaining = bucket.limit
        bucket.reset = time.time() + 3600
    return bucket


def rate_headers(bucket: RateBucket) -> dict[str, str]:
    return {
        "x-ratelimit-limit": str(bucket.limit),
        "x-ratelimit-remaining": str(bucket.remaining),
        "x-ratelimit-reset": str(int(bucket.reset)),
        "x-ratelimit-used": str(bucket.limit - bucket.remaining),
        "x-ratelimit-resource": "core",
    }


async def injected_response(
    failure: Failure, state: StandInState, caller: Caller
) -> web.Response | None:
    if failure.kind == "timeout":
        await asyncio.sleep(failure.delay)
        return None
    if failure.kind == "status":
        return error_response(ApiError(failure.status, failure.message))
    if failure.kind == "suspend":
        return error_response(ApiError(403, "This installation has been suspended"))
    bucket = bucket_for(state, caller.identity)
    headers = rate_headers(bucket)
    if failure.kind == "primary_rate_limit":
        headers["x-ratelimit-remaining"] = "0"
        headers["x-ratelimit-used"] = str(bucket.limit)
        headers["x-ratelimit-reset"] = str(int(time.time() + failure.reset_in))
        return error_response(
            ApiError(
                403,
                f"API rate limit exceeded for {caller.identity}.",
                headers,
                "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api",
            )
        )
    if failure.kind == "secondary_rate_limit":
        if failure.retry_after is not None:
            headers["retry-after"] = str(failure.retry_after)
        return error_response(
            ApiError(
                403,
                "You have exceeded a secondary rate limit. Please wait a few minutes before you "
                "try again.",
                headers,
                "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api"
                "#about-secondary-rate-limits",
            )
        )
    raise ValueError(f"unknown failure kind {failure.kind!r}")


async def rate_limit(request: web.Request) -> web.Response:
    state = state_of(request)
    caller = request[CALLER_KEY]
    bucket = bucket_for(state, caller.identity)
    core = {
        "limit": bucket.limit,
        "remaining": bucket.remaining,
        "reset": int(bucket.reset),
        "used": bucket.limit - bucket.remaining,
        "resource": "core",
    }
    search = {"limit": 30, "remaining": 30, "reset": int(time.time() + 60), "used": 0}
    body = {"resources": {"core": core, "search": {**search, "resource": "search"}}, "rate": core}
    return web.json_response(body, headers=rate_headers(bucket))
