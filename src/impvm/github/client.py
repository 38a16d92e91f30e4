"""Async GitHub REST client for the operator: App/PAT auth, JIT configs, runners, runs/jobs.

Built on githubkit (typed requests and response models). This module adds what the operator
needs on top: installation tokens minted per permission set and cached until shortly before
expiry, typed errors (:mod:`impvm.github.errors`), rate-limit waits, bounded jittered retries,
ETag conditional requests for repeated list reads, and Prometheus metrics.

Sources: GitHub REST docs "Self-hosted runners" (JIT config, list/get/delete runners),
"Self-hosted runner groups", "Workflow runs", "Workflow jobs", "Installations"
(list repositories accessible to the app installation), "Rate limit", "Rate limits for the REST
API" (primary: wait until ``x-ratelimit-reset``; secondary: honour ``retry-after``, else wait at
least one minute, exponentially longer on repeats) and "Best practices for using the REST API"
(conditional requests: a 304 does not count against the primary rate limit).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar, cast

import httpx
from githubkit import GitHub, Response, UnauthAuthStrategy
from githubkit.exception import RequestError, RequestFailed, RequestTimeout
from githubkit.utils import UNSET
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
    identity_of,
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

T = TypeVar("T")

DEFAULT_API_URL = "https://api.github.com"
#: Runner group id of repository-level runners (repositories have only the "Default" group).
REPO_RUNNER_GROUP_ID = 1

RunStatus = Literal[
    "queued", "in_progress", "completed", "waiting", "requested", "pending", "action_required"
]


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


@dataclass(frozen=True)
class Scope:
    """Where runners register: exactly one of ``org`` (login) or ``repo`` (``owner/name``)."""

    org: str | None = None
    repo: str | None = None

    def __post_init__(self) -> None:
        if (self.org is None) == (self.repo is None):
            raise ValueError("Scope needs exactly one of org or repo")
        if self.repo is not None and self.repo.count("/") != 1:
            raise ValueError("Scope.repo must be 'owner/name'")

    @property
    def owner_repo(self) -> tuple[str, str]:
        """``(owner, name)`` of a repository scope; ``ValueError`` for an org scope."""
        if self.repo is None:
            raise ValueError("not a repository scope")
        owner, name = self.repo.split("/")
        return owner, name

    def __str__(self) -> str:
        return f"org {self.org}" if self.org is not None else f"repo {self.repo}"


@dataclass(frozen=True)
class JitConfig:
    """Result of a JIT request. ``encoded_jit_config`` is opaque and secret: ``repr``/``str``
    never show it; read it with ``.get_secret_value()`` only to write the VM's Secret."""

    runner_id: int
    runner_name: str
    encoded_jit_config: SecretStr


@dataclass(frozen=True)
class Runner:
    """A self-hosted runner as GitHub reports it. ``status`` is ``"online"``/``"offline"``."""

    id: int
    name: str
    status: str
    busy: bool
    labels: tuple[str, ...]
    os: str
    runner_group_id: int | None
    ephemeral: bool | None


class DeleteOutcome(enum.Enum):
    """Outcome of :meth:`GitHubClient.delete_runner`."""

    DELETED = "deleted"
    BUSY = "busy"
    NOT_FOUND = "not_found"


@dataclass(frozen=True)
class WorkflowRun:
    """A workflow run (subset). ``repository`` is ``owner/name``."""

    id: int
    name: str | None
    status: str | None
    conclusion: str | None
    repository: str
    run_attempt: int | None
    event: str
    head_branch: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class WorkflowJob:
    """A workflow job (subset). ``runner_*`` are set once a runner took the job."""

    id: int
    run_id: int
    name: str
    status: str
    conclusion: str | None
    labels: tuple[str, ...]
    runner_id: int | None
    runner_name: str | None
    runner_group_id: int | None
    workflow_name: str | None
    head_branch: str | None
    created_at: datetime
    started_at: datetime
    completed_at: datetime | None


@dataclass(frozen=True)
class Repository:
    """A repository the installation can access."""

    id: int
    full_name: str
    owner: str
    name: str
    private: bool


@dataclass(frozen=True)
class RateLimitBucket:
    """One rate-limit resource: ``reset`` is epoch seconds."""

    limit: int
    remaining: int
    used: int
    reset: int


@dataclass(frozen=True)
class Listed(Generic[T]):
    """A list read page by page with conditional requests: the ``items``, the requests made
    (``calls``, one per page) and how many of them GitHub answered 304 Not Modified
    (``not_modified``; the kept answer was used). ``unchanged``: every page was a 304, so the
    list is what it was at the last read (source: REST "Best practices for using the REST
    API", use conditional requests)."""

    items: list[T]
    calls: int
    not_modified: int

    @property
    def unchanged(self) -> bool:
        return self.calls > 0 and self.not_modified == self.calls


@dataclass(frozen=True)
class RetryPolicy:
    """Retry bounds (seconds). Transient failures (5xx, timeouts, connection errors) are retried
    ``max_transient_retries`` times with full-jitter exponential backoff
    (``min(max_delay, base_delay * 2**n) * U[0.5, 1]``). Rate limits are waited for at most
    ``max_rate_limit_retries`` times and never longer than ``max_rate_limit_wait`` per wait;
    beyond that :class:`RateLimited` is raised with ``retry_after`` and ``reset_at``. With
    ``max_rate_limit_retries=0`` the client never waits: the caller decides (the operator's
    pool pass records the condition at once and schedules its retry). A secondary limit without
    ``retry-after`` waits ``secondary_min_wait * 2**n``."""

    max_transient_retries: int = 4
    base_delay: float = 1.0
    max_delay: float = 30.0
    max_rate_limit_retries: int = 3
    max_rate_limit_wait: float = 900.0
    secondary_min_wait: float = 60.0


def _opt(value: Any) -> Any:
    return None if value is UNSET else value


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


Fetch = Callable[[dict[str, str]], Awaitable[Response[T, Any]]]


class _KeptTransport(httpx.AsyncBaseTransport):
    """One connection pool (and one TLS context) for every request of a client. githubkit makes
    an ``httpx.AsyncClient`` per request and closes it afterwards; closing that client must not
    close the pool, so :meth:`aclose` does nothing and :meth:`shutdown` closes it for real (a
    later request opens a new pool)."""

    def __init__(self) -> None:
        self._inner: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._inner is None:
            self._inner = httpx.AsyncHTTPTransport()
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        """Called by each per-request client: keep the pool."""

    async def shutdown(self) -> None:
        """Close the pool's connections."""
        inner, self._inner = self._inner, None
        if inner is not None:
            await inner.aclose()


class _Shared:
    """State shared by a client and its :meth:`GitHubClient.with_permissions` views."""

    def __init__(
        self,
        credentials: Credentials,
        api_url: str,
        timeout: float,
        retry: RetryPolicy,
        sleep: Callable[[float], Awaitable[None]],
        clock: Callable[[], float],
        token_refresh_margin: float,
        page_size: int,
        etag_cache_size: int,
    ) -> None:
        self.credentials = credentials
        self.api_url = api_url
        self.identity = identity_of(credentials, api_url)
        #: GitHub accepted these credentials: an installation token was minted (App) or a
        #: request answered (PAT)
        self.proven = False
        self.transport = _KeptTransport()
        self.gh = GitHub(
            UnauthAuthStrategy(),
            base_url=api_url,
            timeout=timeout,
            auto_retry=False,
            http_cache=False,
            user_agent="impvm",
            async_transport=self.transport,
        )
        self.retry = retry
        self.sleep = sleep
        self.clock = clock
        self.tokens = TokenCache(refresh_margin=token_refresh_margin)
        self.mint_locks: dict[Hashable, asyncio.Lock] = {}
        self.page_size = page_size
        self.etags: OrderedDict[Hashable, tuple[str, Any]] = OrderedDict()
        self.etag_cache_size = etag_cache_size
        #: last rate-limit headers seen per resource (``x-ratelimit-resource``)
        self.budget: dict[str, RateLimitBucket] = {}

    def secrets(self) -> list[str]:
        out = self.tokens.secrets()
        if isinstance(self.credentials, AppCredentials):
            out.append(self.credentials.private_key.get_secret_value())
        else:
            out.append(self.credentials.token.get_secret_value())
        return out

    def redact(self, text: str) -> str:
        for secret in self.secrets():
            if secret:
                text = text.replace(secret, "***")
        return text


class GitHubClient:
    """Async GitHub REST client for one set of credentials (one App installation or one PAT).

    ``credentials``: :class:`AppCredentials` or :class:`PatCredentials`. ``server_url``: the
    pool's ``platform.serverURL`` (see :func:`api_base_url`); ``api_url`` overrides the computed
    base. ``timeout`` is seconds per request. ``sleep``/``clock``/``rng`` are injectable for
    tests (defaults: ``asyncio.sleep``, ``time.time``, ``random.random``). ``page_size`` is the
    ``per_page`` of list calls (GitHub max 100). ``etag_cache_size`` bounds the conditional-
    request cache (entries, least recently used dropped): a poll of 500 repositories keeps two
    run listings each, so it must hold more than the pages one poll sweep reads.

    Each method requests an installation token with only the permissions it needs (e.g. JIT for
    an org: ``organization_self_hosted_runners: write``; repo: ``administration: write``;
    runs/jobs: ``actions: read``) unless the client was restricted with
    :meth:`with_permissions`. Tokens are cached per permission set until
    ``token_refresh_margin`` seconds before ``expires_at``.

    Errors: every method raises only :class:`impvm.github.errors.GitHubError` subclasses.
    Call :meth:`close` (or use ``async with``) when done.
    """

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
        self._shared = _Shared(
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
        return f"GitHubClient(api_url={self._shared.api_url!r})"

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

    def with_permissions(self, permissions: Permissions) -> GitHubClient:
        """A view of this client whose calls all use a token restricted to ``permissions``
        (e.g. ``{"actions": "read"}``). Shares connection, token and ETag caches."""
        view = object.__new__(GitHubClient)
        view._shared = self._shared
        view._rng = self._rng
        view._permissions = dict(permissions)
        return view

    async def close(self) -> None:
        """Release resources (tokens, ETags, connections). Idempotent."""
        self._shared.tokens = TokenCache(refresh_margin=self._shared.tokens.refresh_margin)
        self._shared.etags.clear()
        await self._shared.transport.shutdown()

    async def __aenter__(self) -> GitHubClient:
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

    async def _get(
        self, endpoint: str, perms: Permissions, cache_key: Hashable, fetch: Fetch[T]
    ) -> T:
        """GET with ETag revalidation: a 304 returns the cached parsed body."""
        data, _ = await self._get_conditional(endpoint, perms, cache_key, fetch)
        return data

    async def _get_conditional(
        self, endpoint: str, perms: Permissions, cache_key: Hashable, fetch: Fetch[T]
    ) -> tuple[T, bool]:
        """GET with ``If-None-Match`` when an ETag of ``cache_key`` is kept: returns the body
        and whether GitHub answered 304 (the kept body is returned then)."""
        shared = self._shared
        key = (cache_key, permissions_key(perms))
        cached = shared.etags.get(key)
        extra = {"If-None-Match": cached[0]} if cached is not None else None
        resp = await self._send(endpoint, "GET", perms, fetch, extra_headers=extra)
        if resp.status_code == 304 and cached is not None:
            shared.etags.move_to_end(key)
            return cast(T, cached[1]), True
        data = resp.parsed_data
        etag = resp.headers.get("etag")
        if etag:
            shared.etags[key] = (etag, data)
            shared.etags.move_to_end(key)
            while len(shared.etags) > shared.etag_cache_size:
                shared.etags.popitem(last=False)
        return data, False

    async def _paginate(
        self,
        endpoint: str,
        perms: Permissions,
        cache_key: Hashable,
        fetch_page: Callable[[int, int, dict[str, str]], Awaitable[Response[Any, Any]]],
        items: Callable[[Any], Sequence[Any]],
        total: Callable[[Any], int],
    ) -> list[Any]:
        """Read all pages (``per_page`` = page size) until a short page or ``total_count``."""
        listed = await self._paginate_conditional(
            endpoint, perms, cache_key, fetch_page, items, total
        )
        return listed.items

    async def _paginate_conditional(
        self,
        endpoint: str,
        perms: Permissions,
        cache_key: Hashable,
        fetch_page: Callable[[int, int, dict[str, str]], Awaitable[Response[Any, Any]]],
        items: Callable[[Any], Sequence[Any]],
        total: Callable[[Any], int],
    ) -> Listed[Any]:
        """:meth:`_paginate`, counting the requests and the 304s among them."""
        size = self._shared.page_size
        out: list[Any] = []
        page = calls = not_modified = 0
        while True:
            page += 1
            fetch: Fetch[Any] = functools.partial(fetch_page, page, size)
            data, cached = await self._get_conditional(
                endpoint, perms, (cache_key, page, size), fetch
            )
            calls += 1
            not_modified += cached
            batch = items(data)
            out.extend(batch)
            if len(batch) < size or len(out) >= total(data):
                return Listed(out, calls, not_modified)

    # ------------------------------------------------------------------ runner groups

    async def runner_group_id(self, org: str, name: str | None = None) -> int:
        """Id of the org runner group ``name``; ``None`` -> the group with ``default: true``.
        Reads all pages. Raises :class:`NotFound` if no such group.
        Source: REST "Self-hosted runner groups" (list self-hosted runner groups for an org);
        needs ``organization_self_hosted_runners: read``."""
        gh = self._shared.gh
        endpoint = "/orgs/{org}/actions/runner-groups"
        groups = await self._paginate(
            endpoint,
            self._perms({"organization_self_hosted_runners": "read"}),
            ("runner-groups", org),
            lambda p, n, h: gh.rest.actions.async_list_self_hosted_runner_groups_for_org(
                org, per_page=n, page=p, headers=h
            ),
            lambda d: d.runner_groups,
            lambda d: d.total_count,
        )
        for group in groups:
            if (name is None and group.default) or (name is not None and group.name == name):
                return int(group.id)
        wanted = "default runner group" if name is None else f"runner group {name!r}"
        raise NotFound(f"{wanted} not found in org {org}", endpoint=endpoint, status=404)

    # ------------------------------------------------------------------ runners

    async def generate_jitconfig(
        self,
        scope: Scope,
        name: str,
        runner_group_id: int,
        labels: Sequence[str],
        work_folder: str = "_work",
    ) -> JitConfig:
        """Create a JIT runner configuration (``POST .../actions/runners/generate-jitconfig``).

        ``name`` must be unique in the scope (else :class:`Conflict`, 409); ``labels`` are the
        pool's labels (GitHub requires 1..100; empty -> ``["self-hosted"]``). For a repo scope
        use :data:`REPO_RUNNER_GROUP_ID`. Needs ``organization_self_hosted_runners: write``
        (org) or ``administration: write`` (repo). Not idempotent: a retried request that had
        succeeded surfaces as :class:`Conflict`.
        Source: REST "Self-hosted runners", create configuration for a just-in-time runner."""
        gh = self._shared.gh
        body: dict[str, Any] = {
            "name": name,
            "runner_group_id": runner_group_id,
            "labels": list(labels) or ["self-hosted"],
            "work_folder": work_folder,
        }
        if scope.org is not None:
            org = scope.org
            resp = await self._send(
                "/orgs/{org}/actions/runners/generate-jitconfig",
                "POST",
                self._perms({"organization_self_hosted_runners": "write"}),
                lambda h: gh.rest.actions.async_generate_runner_jitconfig_for_org(
                    org, headers=h, data=cast(Any, body)
                ),
            )
            data: Any = resp.parsed_data
        else:
            owner, repo = scope.owner_repo
            resp2 = await self._send(
                "/repos/{owner}/{repo}/actions/runners/generate-jitconfig",
                "POST",
                self._perms({"administration": "write"}),
                lambda h: gh.rest.actions.async_generate_runner_jitconfig_for_repo(
                    owner, repo, headers=h, data=cast(Any, body)
                ),
            )
            data = resp2.parsed_data
        return JitConfig(
            runner_id=int(data.runner.id),
            runner_name=str(data.runner.name),
            encoded_jit_config=SecretStr(data.encoded_jit_config),
        )

    @staticmethod
    def _runner(model: Any) -> Runner:
        return Runner(
            id=int(model.id),
            name=str(model.name),
            status=str(model.status),
            busy=bool(model.busy),
            labels=tuple(label.name for label in model.labels),
            os=str(model.os),
            runner_group_id=_opt(model.runner_group_id),
            ephemeral=_opt(model.ephemeral),
        )

    def _runner_perms(self, scope: Scope, level: str) -> Permissions:
        if scope.org is not None:
            return self._perms({"organization_self_hosted_runners": level})
        return self._perms({"administration": level})

    async def list_runners(self, scope: Scope, name_prefix: str = "") -> list[Runner]:
        """All self-hosted runners of the scope whose name starts with ``name_prefix``
        (all pages; ETag-revalidated). Source: REST "Self-hosted runners", list runners."""
        gh = self._shared.gh
        perms = self._runner_perms(scope, "read")
        if scope.org is not None:
            org = scope.org
            models = await self._paginate(
                "/orgs/{org}/actions/runners",
                perms,
                ("runners", str(scope)),
                lambda p, n, h: gh.rest.actions.async_list_self_hosted_runners_for_org(
                    org, per_page=n, page=p, headers=h
                ),
                lambda d: d.runners,
                lambda d: d.total_count,
            )
        else:
            owner, repo = scope.owner_repo
            models = await self._paginate(
                "/repos/{owner}/{repo}/actions/runners",
                perms,
                ("runners", str(scope)),
                lambda p, n, h: gh.rest.actions.async_list_self_hosted_runners_for_repo(
                    owner, repo, per_page=n, page=p, headers=h
                ),
                lambda d: d.runners,
                lambda d: d.total_count,
            )
        return [self._runner(m) for m in models if str(m.name).startswith(name_prefix)]

    async def get_runner(self, scope: Scope, runner_id: int) -> Runner | None:
        """One runner, or ``None`` if GitHub no longer knows it (404).
        Source: REST "Self-hosted runners", get a self-hosted runner."""
        gh = self._shared.gh
        perms = self._runner_perms(scope, "read")
        try:
            if scope.org is not None:
                org = scope.org
                resp: Response[Any, Any] = await self._send(
                    "/orgs/{org}/actions/runners/{runner_id}",
                    "GET",
                    perms,
                    lambda h: gh.rest.actions.async_get_self_hosted_runner_for_org(
                        org, runner_id, headers=h
                    ),
                )
            else:
                owner, repo = scope.owner_repo
                resp = await self._send(
                    "/repos/{owner}/{repo}/actions/runners/{runner_id}",
                    "GET",
                    perms,
                    lambda h: gh.rest.actions.async_get_self_hosted_runner_for_repo(
                        owner, repo, runner_id, headers=h
                    ),
                )
        except NotFound:
            return None
        return self._runner(resp.parsed_data)

    async def delete_runner(self, scope: Scope, runner_id: int) -> DeleteOutcome:
        """Remove a runner registration: 204 -> ``DELETED``; 422 (runner still running a job)
        -> ``BUSY``; 404 -> ``NOT_FOUND``. Other failures raise.
        Source: REST "Self-hosted runners", delete a self-hosted runner."""
        gh = self._shared.gh
        perms = self._runner_perms(scope, "write")
        try:
            if scope.org is not None:
                org = scope.org
                await self._send(
                    "/orgs/{org}/actions/runners/{runner_id}",
                    "DELETE",
                    perms,
                    lambda h: gh.rest.actions.async_delete_self_hosted_runner_from_org(
                        org, runner_id, headers=h
                    ),
                )
            else:
                owner, repo = scope.owner_repo
                await self._send(
                    "/repos/{owner}/{repo}/actions/runners/{runner_id}",
                    "DELETE",
                    perms,
                    lambda h: gh.rest.actions.async_delete_self_hosted_runner_from_repo(
                        owner, repo, runner_id, headers=h
                    ),
                )
        except NotFound:
            return DeleteOutcome.NOT_FOUND
        except RequestRejected as exc:
            if exc.status == 422:
                return DeleteOutcome.BUSY
            raise
        return DeleteOutcome.DELETED

    # ------------------------------------------------------------------ runs and jobs

    @staticmethod
    def _run(model: Any) -> WorkflowRun:
        return WorkflowRun(
            id=int(model.id),
            name=_opt(model.name),
            status=model.status,
            conclusion=model.conclusion,
            repository=str(model.repository.full_name),
            run_attempt=_opt(model.run_attempt),
            event=str(model.event),
            head_branch=model.head_branch,
            created_at=model.created_at,
            updated_at=model.updated_at,
        )

    @staticmethod
    def _job(model: Any) -> WorkflowJob:
        return WorkflowJob(
            id=int(model.id),
            run_id=int(model.run_id),
            name=str(model.name),
            status=str(model.status),
            conclusion=model.conclusion,
            labels=tuple(model.labels),
            runner_id=model.runner_id,
            runner_name=model.runner_name,
            runner_group_id=model.runner_group_id,
            workflow_name=model.workflow_name,
            head_branch=model.head_branch,
            created_at=model.created_at,
            started_at=model.started_at,
            completed_at=model.completed_at,
        )

    @staticmethod
    def _split(repo: str) -> tuple[str, str]:
        return Scope(repo=repo).owner_repo

    async def list_runs(self, repo: str, status: RunStatus) -> list[WorkflowRun]:
        """Workflow runs of ``repo`` (``owner/name``) with ``status`` (all pages, ETag).
        Needs ``actions: read``. Source: REST "Workflow runs", list workflow runs for a repo."""
        return (await self.read_runs(repo, status)).items

    async def read_runs(self, repo: str, status: RunStatus) -> Listed[WorkflowRun]:
        """:meth:`list_runs` with the requests it made and the 304s among them."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        listed = await self._paginate_conditional(
            "/repos/{owner}/{repo}/actions/runs",
            self._perms({"actions": "read"}),
            ("runs", repo, status),
            lambda p, n, h: gh.rest.actions.async_list_workflow_runs_for_repo(
                owner, name, status=status, per_page=n, page=p, headers=h
            ),
            lambda d: d.workflow_runs,
            lambda d: d.total_count,
        )
        return Listed([self._run(m) for m in listed.items], listed.calls, listed.not_modified)

    async def list_run_jobs(
        self, repo: str, run_id: int, filter: Literal["latest", "all"] = "latest"
    ) -> list[WorkflowJob]:
        """Jobs of a workflow run (all pages, ETag). ``filter``: ``latest`` attempt or ``all``.
        Needs ``actions: read``. Source: REST "Workflow jobs", list jobs for a workflow run."""
        return (await self.read_run_jobs(repo, run_id, filter)).items

    async def read_run_jobs(
        self, repo: str, run_id: int, filter: Literal["latest", "all"] = "latest"
    ) -> Listed[WorkflowJob]:
        """:meth:`list_run_jobs` with the requests it made and the 304s among them."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        listed = await self._paginate_conditional(
            "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs",
            self._perms({"actions": "read"}),
            ("jobs", repo, run_id, filter),
            lambda p, n, h: gh.rest.actions.async_list_jobs_for_workflow_run(
                owner, name, run_id, filter_=filter, per_page=n, page=p, headers=h
            ),
            lambda d: d.jobs,
            lambda d: d.total_count,
        )
        return Listed([self._job(m) for m in listed.items], listed.calls, listed.not_modified)

    async def get_run(self, repo: str, run_id: int) -> WorkflowRun | None:
        """One workflow run, ``None`` on 404. Source: REST "Workflow runs", get a run."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        try:
            data = await self._get(
                "/repos/{owner}/{repo}/actions/runs/{run_id}",
                self._perms({"actions": "read"}),
                ("run", repo, run_id),
                lambda h: gh.rest.actions.async_get_workflow_run(owner, name, run_id, headers=h),
            )
        except NotFound:
            return None
        return self._run(data)

    async def get_job(self, repo: str, job_id: int) -> WorkflowJob | None:
        """One workflow job, ``None`` on 404. Source: REST "Workflow jobs", get a job."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        try:
            data = await self._get(
                "/repos/{owner}/{repo}/actions/jobs/{job_id}",
                self._perms({"actions": "read"}),
                ("job", repo, job_id),
                lambda h: gh.rest.actions.async_get_job_for_workflow_run(
                    owner, name, job_id, headers=h
                ),
            )
        except NotFound:
            return None
        return self._job(data)

    # ------------------------------------------------------------------ installation

    async def list_installation_repos(self) -> list[Repository]:
        """Repositories the installation can access (all pages, ETag).
        Source: REST "Installations", list repositories accessible to the app installation."""
        return (await self.read_installation_repos()).items

    async def read_installation_repos(self) -> Listed[Repository]:
        """:meth:`list_installation_repos` with the requests it made and the 304s among them."""
        gh = self._shared.gh
        listed = await self._paginate_conditional(
            "/installation/repositories",
            self._perms({"metadata": "read"}),
            ("installation-repos",),
            lambda p, n, h: gh.rest.apps.async_list_repos_accessible_to_installation(
                per_page=n, page=p, headers=h
            ),
            lambda d: d.repositories,
            lambda d: d.total_count,
        )
        repos = [
            Repository(
                id=int(m.id),
                full_name=str(m.full_name),
                owner=str(m.owner.login),
                name=str(m.name),
                private=bool(m.private),
            )
            for m in listed.items
        ]
        return Listed(repos, listed.calls, listed.not_modified)

    async def rate_limit(self) -> dict[str, RateLimitBucket]:
        """``GET /rate_limit``: buckets by resource (``core``, ``search``, ...). Does not count
        against the primary rate limit. Source: REST "Rate limit"."""
        gh = self._shared.gh
        resp = await self._send(
            "/rate_limit",
            "GET",
            self._perms({"metadata": "read"}),
            lambda h: gh.rest.rate_limit.async_get(headers=h),
        )
        resources = resp.parsed_data.resources
        out: dict[str, RateLimitBucket] = {}
        for name, bucket in resources.model_dump(exclude_none=True).items():
            if isinstance(bucket, dict) and {"limit", "remaining", "used", "reset"} <= set(bucket):
                out[name] = RateLimitBucket(
                    limit=int(bucket["limit"]),
                    remaining=int(bucket["remaining"]),
                    used=int(bucket["used"]),
                    reset=int(bucket["reset"]),
                )
        return out
