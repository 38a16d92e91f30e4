"""The transport under the GitHub client: one githubkit instance and connection pool per set of
credentials, installation tokens minted per permission set and cached until shortly before
expiry, typed errors (:mod:`impvm.github.errors`), rate-limit waits and bounded jittered
retries. The shared state is in :mod:`impvm.github.shared`, the conditional and paginated reads
in :mod:`impvm.github.reads`, the endpoints in :mod:`impvm.github.client`.

Sources: GitHub REST docs "Authenticating as a GitHub App installation" (installation tokens),
"Rate limits for the REST API" (primary: wait until ``x-ratelimit-reset``; secondary: honour
``retry-after``, else wait at least one minute, exponentially longer on repeats) and "Best
practices for using the REST API" (conditional requests: a 304 does not count against the primary
rate limit).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, Self, TypeVar, cast

import httpx
from githubkit import Response
from githubkit.exception import RequestError, RequestFailed, RequestTimeout
from pydantic import SecretStr

from impvm.github import metrics
from impvm.github.auth import (
    AppCredentials,
    CredentialIdentity,
    Credentials,
    PatCredentials,
    Permissions,
    TokenCache,
    create_app_jwt,
    permissions_key,
)
from impvm.github.errors import (
    BadCredentials,
    Conflict,
    GitHubError,
    InstallationUnavailable,
    NotFound,
    PermissionNotGranted,
    RateLimited,
    RequestRejected,
    TransientError,
)
from impvm.github.shared import SharedState
from impvm.github.types import (
    DEFAULT_API_URL,
    RateLimitBucket,
    RetryPolicy,
)


def api_base_url(server_url: str | None) -> str:
    """REST API base for ``platform.serverURL``.

    ``None``, ``https://github.com`` or ``https://api.github.com`` -> ``https://api.github.com``;
    any other ``https://HOST`` (GitHub Enterprise Server) -> ``https://HOST/api/v3``.
    Source: GitHub Enterprise Server docs, "Getting started with the REST API" (base URL)."""
    if not server_url:
        return DEFAULT_API_URL
    url = server_url.rstrip("/")
    host = httpx.URL(url).host
    if host in ("github.com", "api.github.com"):
        return DEFAULT_API_URL
    if url.endswith("/api/v3"):
        return url
    return url + "/api/v3"


T = TypeVar("T")


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


Fetch = Callable[[dict[str, str]], Awaitable[Response[T, Any]]]


class GitHubTransport:
    """Requests for one set of credentials: authorization, sending with retries and rate-limit
    waits. :class:`impvm.github.reads.GitHubReads` adds conditional and paginated reads,
    :class:`impvm.github.client.GitHubClient` the endpoints; its docstring gives the
    constructor's parameters."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        server_url: str | None = None,
        api_url: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
        token_refresh_margin: float = 300.0,
        page_size: int = 100,
        etag_cache_size: int = 16384,
    ) -> None:
        self._shared = SharedState(
            credentials,
            api_url or api_base_url(server_url),
            timeout,
            retry or RetryPolicy(),
            sleep,
            clock,
            token_refresh_margin,
            page_size,
            etag_cache_size,
        )
        self._rng = rng
        self._permissions: Permissions | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(api_url={self._shared.api_url!r})"

    @property
    def api_url(self) -> str:
        """The REST API base URL in use."""
        return self._shared.api_url

    @property
    def identity(self) -> CredentialIdentity:
        """Who this client is (:class:`CredentialIdentity`: no secret in it). A client's
        credentials never change: other credentials get another client, with their own tokens
        and caches."""
        return self._shared.identity

    @property
    def installation(self) -> str | None:
        """:attr:`CredentialIdentity.installation` once GitHub accepted the credentials (an
        installation token was minted for that installation, or a PAT's request answered),
        else None: claiming an App ID and installation ID in a Secret proves nothing."""
        return self._shared.identity.installation if self._shared.proven else None

    def _record_budget(self, resource: str, headers: Any) -> None:
        def num(name: str) -> int:
            raw = headers.get(name, "")
            return int(raw) if raw.isdigit() else 0

        self._shared.budget[resource] = RateLimitBucket(
            limit=num("x-ratelimit-limit"),
            remaining=num("x-ratelimit-remaining"),
            used=num("x-ratelimit-used"),
            reset=num("x-ratelimit-reset"),
        )

    def rate_budget(self, resource: str = "core") -> RateLimitBucket | None:
        """The rate-limit budget of ``resource`` as the last response reported it (headers
        ``x-ratelimit-*``; ``reset`` in epoch seconds), or None before any response. Free: no
        request is made (source: REST "Rate limits for the REST API", checking your status)."""
        return self._shared.budget.get(resource)

    def with_permissions(self, permissions: Permissions) -> Self:
        """A view of this client whose calls all use a token restricted to ``permissions``
        (e.g. ``{"actions": "read"}``). Shares connection, token and ETag caches."""
        view = object.__new__(type(self))
        view._shared = self._shared
        view._rng = self._rng
        view._permissions = dict(permissions)
        return view

    async def close(self) -> None:
        """Release resources (tokens, ETags, connections). Idempotent."""
        self._shared.tokens = TokenCache(refresh_margin=self._shared.tokens.refresh_margin)
        self._shared.etags.clear()
        await self._shared.transport.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ auth

    def _perms(self, needed: Permissions) -> Permissions:
        return self._permissions if self._permissions is not None else needed

    async def _authorization(self, perms: Permissions) -> str:
        creds = self._shared.credentials
        if isinstance(creds, PatCredentials):
            return f"Bearer {creds.token.get_secret_value()}"
        token = self._shared.tokens.get(creds.installation_id, perms, self._shared.clock())
        if token is None:
            token = await self._mint(creds, perms)
        return f"token {token.get_secret_value()}"

    async def _mint(self, creds: AppCredentials, perms: Permissions) -> SecretStr:
        key = (creds.installation_id, permissions_key(perms))
        lock = self._shared.mint_locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._shared.tokens.get(creds.installation_id, perms, self._shared.clock())
            if cached is not None:
                return cached
            bearer = "Bearer " + create_app_jwt(creds.app_id, creds.private_key.get_secret_value())
            gh = self._shared.gh
            body: dict[str, Any] = {"permissions": dict(perms)} if perms else {}
            try:
                resp = await self._send(
                    "/app/installations/{installation_id}/access_tokens",
                    "POST",
                    perms,
                    lambda h: gh.rest.apps.async_create_installation_access_token(
                        creds.installation_id, headers=h, data=cast(Any, body)
                    ),
                    authorization=bearer,
                    minting=True,
                )
                token = resp.parsed_data
            except GitHubError as exc:
                metrics.TOKEN_MINTS.labels(result=type(exc).__name__).inc()
                if isinstance(exc, BadCredentials | InstallationUnavailable):
                    self._shared.proven = False  # a revoked key or a removed installation
                raise
            secret = SecretStr(token.token)
            self._shared.tokens.put(creds.installation_id, perms, secret, _epoch(token.expires_at))
            self._shared.proven = True
            metrics.TOKEN_MINTS.labels(result="ok").inc()
            return secret

    # ------------------------------------------------------------------ transport

    def _error(self, endpoint: str, resp: Response[Any, Any], minting: bool) -> GitHubError:
        status = resp.status_code
        try:
            payload = resp.json()
            message = str(payload.get("message", "")) if isinstance(payload, dict) else ""
        except ValueError:
            message = ""
        text = self._shared.redact(f"GitHub {status} on {endpoint}: {message}".rstrip(": "))
        lowered = message.lower()
        if status == 401:
            return BadCredentials(text, endpoint=endpoint, status=status)
        if minting and status == 404:
            return InstallationUnavailable(text, reason="removed", endpoint=endpoint, status=status)
        if status == 403 and (minting or "suspended" in lowered):
            return InstallationUnavailable(
                text, reason="suspended", endpoint=endpoint, status=status
            )
        if (minting and status == 422) or status == 403:
            return PermissionNotGranted(text, endpoint=endpoint, status=status)
        if status == 404:
            return NotFound(text, endpoint=endpoint, status=status)
        if status == 409:
            return Conflict(text, endpoint=endpoint, status=status)
        if status >= 500:
            return TransientError(text, endpoint=endpoint, status=status)
        return RequestRejected(text, endpoint=endpoint, status=status)

    def _rate_limit_wait(self, resp: Response[Any, Any], attempt: int) -> tuple[str, float] | None:
        if resp.status_code not in (403, 429):
            return None
        headers = resp.headers
        try:
            payload = resp.json()
            message = str(payload.get("message", "")).lower() if isinstance(payload, dict) else ""
        except ValueError:
            message = ""
        secondary = "secondary rate limit" in message
        if "retry-after" in headers:
            try:
                wait = float(headers["retry-after"])
            except ValueError:
                wait = self._shared.retry.secondary_min_wait
            primary = headers.get("x-ratelimit-remaining") == "0" and not secondary
            return ("primary" if primary else "secondary", max(wait, 0.0))
        if headers.get("x-ratelimit-remaining") == "0" and not secondary:
            try:
                reset = float(headers["x-ratelimit-reset"])
            except (KeyError, ValueError):
                return ("primary", self._shared.retry.secondary_min_wait)
            return ("primary", max(reset - self._shared.clock(), 0.0) + 1.0)
        if secondary or resp.status_code == 429:
            return ("secondary", self._shared.retry.secondary_min_wait * 2**attempt)
        return None

    async def _send(
        self,
        endpoint: str,
        method: str,
        perms: Permissions,
        fetch: Fetch[T],
        *,
        authorization: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        minting: bool = False,
    ) -> Response[T, Any]:
        """Send one logical request with auth, retries and metrics; return a 2xx/304 response
        or raise a typed error."""
        shared = self._shared
        policy = shared.retry
        transient = 0
        limited = 0
        reauthed = False
        while True:
            auth = authorization or await self._authorization(perms)
            headers = {"Authorization": auth, **(extra_headers or {})}
            failure: GitHubError
            try:
                resp = await fetch(headers)
            except RequestFailed as exc:
                resp = exc.response
            except RequestTimeout:
                metrics.API_CALLS.labels(endpoint=endpoint, method=method, status="timeout").inc()
                failure = TransientError(f"GitHub timeout on {endpoint}", endpoint=endpoint)
                resp = None
            except RequestError as exc:
                metrics.API_CALLS.labels(endpoint=endpoint, method=method, status="error").inc()
                reason = type(getattr(exc, "exc", exc)).__name__
                failure = TransientError(
                    f"GitHub connection error on {endpoint}: {reason}", endpoint=endpoint
                )
                resp = None
            if resp is not None:
                metrics.API_CALLS.labels(
                    endpoint=endpoint, method=method, status=str(resp.status_code)
                ).inc()
                remaining = resp.headers.get("x-ratelimit-remaining")
                if remaining is not None and remaining.isdigit():
                    resource = resp.headers.get("x-ratelimit-resource", "core")
                    metrics.RATE_LIMIT_REMAINING.labels(resource=resource).set(int(remaining))
                    self._record_budget(resource, resp.headers)
                if resp.status_code < 400:
                    if not minting and isinstance(shared.credentials, PatCredentials):
                        shared.proven = True
                    return resp
                wait = self._rate_limit_wait(resp, limited)
                if wait is not None:
                    kind, seconds = wait
                    if limited >= policy.max_rate_limit_retries or (
                        seconds > policy.max_rate_limit_wait
                    ):
                        raise RateLimited(
                            f"GitHub {kind} rate limit on {endpoint}; retry after {seconds:.0f} s",
                            kind=kind,
                            retry_after=seconds,
                            endpoint=endpoint,
                            status=resp.status_code,
                            reset_at=shared.clock() + seconds,
                        )
                    limited += 1
                    metrics.RATE_LIMIT_WAITS.labels(kind=kind).inc()
                    await shared.sleep(seconds)
                    continue
                if (
                    resp.status_code == 401
                    and not minting
                    and not reauthed
                    and isinstance(shared.credentials, AppCredentials)
                ):
                    # A cached token may have been revoked: mint a fresh one once.
                    shared.tokens.drop(shared.credentials.installation_id, perms)
                    reauthed = True
                    continue
                failure = self._error(endpoint, resp, minting)
                if isinstance(failure, BadCredentials) and isinstance(
                    shared.credentials, PatCredentials
                ):
                    shared.proven = False  # a revoked token
                if not isinstance(failure, TransientError):
                    raise failure
            transient += 1
            if transient > policy.max_transient_retries:
                raise failure
            delay = min(policy.max_delay, policy.base_delay * 2 ** (transient - 1))
            await shared.sleep(delay * (0.5 + 0.5 * self._rng()))
