"""What a GitHub client and its :meth:`~impvm.github.client.GitHubClient.with_permissions`
views share (:class:`SharedState`): one githubkit instance over one kept connection pool
(:class:`KeptTransport`), the installation-token cache, the ETag cache, the last rate-limit
headers, and the credentials' secrets for redaction."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import httpx
from githubkit import GitHub, UnauthAuthStrategy

from impvm.github.auth import AppCredentials, Credentials, TokenCache, identity_of
from impvm.github.types import RateLimitBucket, RetryPolicy


class KeptTransport(httpx.AsyncBaseTransport):
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


class SharedState:
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
        self.transport = KeptTransport()
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
