"""Reads that GitHub lets a client repeat cheaply, over :class:`GitHubTransport`: ETag
conditional GETs (a 304 answers with the kept body and does not count against the primary
rate limit) and paginated lists read page by page with the same revalidation
(``per_page`` = the client's page size, until a short page or ``total_count``).

Source: GitHub REST docs, "Best practices for using the REST API" (conditional requests) and
"Using pagination in the REST API".
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar, cast

from githubkit import Response

from impvm.github.auth import Permissions, permissions_key
from impvm.github.transport import Fetch, GitHubTransport
from impvm.github.types import Listed

T = TypeVar("T")


class GitHubReads(GitHubTransport):
    """:class:`GitHubTransport` with conditional and paginated reads (the endpoints of
    :class:`impvm.github.client.GitHubClient` build on them)."""

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
