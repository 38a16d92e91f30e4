"""One source of GitHub credentials and clients for the whole operator.

The pool pass, the reaper and pool teardown all ask :class:`GitHubProvider` for a pool's client.
It reads the pool's credentials Secret (``spec.platform.credentialsSecret`` in the pool's
namespace; keys as in docs/architecture.md), parses it only when its ``resourceVersion`` changed
(the App key is parsed once), and hands out one :class:`GitHubClient` per credential identity
(:class:`~impvm.github.auth.CredentialIdentity`: REST base, App ID, installation ID and the
fingerprint of the key's public half; for a PAT the token's fingerprint). So one token cache, one
ETag cache, one connection pool, one job poller and one runner-list directory entry serve exactly
the pools whose Secrets hold the same key: a Secret that names another tenant's App ID and
installation ID with a key of its own gets a client of its own, whose token mint GitHub refuses.
An installation token is only ever used by the credentials that minted it.

A rotated key (the Secret now holds another key) gets a new client; the old one, once no Secret
names its key any more, is retired: ``on_retire`` is told (the operator drops its poller and its
runner lists) and it is closed, its tokens and ETags with it.

GitHub rate limits are never waited for inside a request here: the client raises
:class:`~impvm.github.errors.RateLimited` and the pass decides (condition at once, retry after
the reset).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret

from impvm.api.models import Platform
from impvm.github import (
    GitHubClient,
    RetryPolicy,
    Scope,
    api_base_url,
    credentials_from_secret,
)
from impvm.github.auth import CredentialIdentity, identity_of
from impvm.github.errors import CredentialsError

log = logging.getLogger("impvm.operator.credentials")

#: ``(namespace, name) -> Secret as a dict, or None when missing`` (may raise ``ApiError``).
SecretReader = Callable[[str, str], Awaitable[dict[str, Any] | None]]


def scope_of(platform: Platform) -> Scope:
    """The GitHub scope (org or repository) of a pool's ``spec.platform``."""
    return Scope(org=platform.scope.org, repo=platform.scope.repo)


@dataclass(frozen=True)
class _SecretSeen:
    version: tuple[str, str | None, str]  # resourceVersion, serverURL, tokenSource
    identity: CredentialIdentity


class GitHubProvider:
    """Clients for pools' credentials Secrets, one per credential identity (see the module
    docstring).

    ``api_url`` overrides the REST base of every pool (the stand-in); ``timeout`` is seconds
    per request; ``retry`` bounds transient retries (rate limits are never waited for);
    ``on_retire(client)`` is called for a client no Secret uses any more, before it is
    closed."""

    def __init__(
        self,
        kube: AsyncClient,
        *,
        api_url: str | None = None,
        timeout: float = 15.0,
        retry: RetryPolicy | None = None,
        secrets: SecretReader | None = None,
        on_retire: Callable[[GitHubClient], None] | None = None,
    ) -> None:
        self.kube = kube
        self.secrets = secrets
        self.api_url = api_url
        self.timeout = timeout
        self.retry = dataclasses.replace(retry or RetryPolicy(), max_rate_limit_retries=0)
        self.on_retire = on_retire
        self._clients: dict[CredentialIdentity, GitHubClient] = {}
        self._secrets: dict[tuple[str, str], _SecretSeen] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def client(self, namespace: str, platform: Platform) -> GitHubClient:
        """The client for the credentials Secret a pool in ``namespace`` names.

        Raises :class:`CredentialsError` when the Secret is missing (404), unreadable (403) or
        lacks a key; the message names the Secret and the key, never a value."""
        name = platform.credentials_secret
        try:
            sec = await self._read(namespace, name)
            version = str((sec.get("metadata") or {}).get("resourceVersion") or "")
            stamp = (version, platform.server_url, platform.token_source)
            seen = self._secrets.get((namespace, name))
            if seen is not None and seen.version == stamp and seen.identity in self._clients:
                return self._clients[seen.identity]
            data = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
            creds = credentials_from_secret(data, platform.token_source)
        except CredentialsError:
            self.forget(namespace, name)  # its old key is no longer what the Secret says
            raise
        base = self.api_url or api_base_url(platform.server_url)
        identity = identity_of(creds, base)
        client = self._clients.get(identity)
        if client is None:
            client = self._clients[identity] = GitHubClient(
                creds, api_url=base, timeout=self.timeout, retry=self.retry
            )
        self._secrets[(namespace, name)] = _SecretSeen(stamp, identity)
        if seen is not None and seen.identity != identity:
            log.info("credentials Secret %s/%s: now %s", namespace, name, identity)
            self._release(seen.identity)
        return client

    async def _read(self, namespace: str, name: str) -> dict[str, Any]:
        """The credentials Secret as a dict (through ``secrets`` when given: the operator's
        watch cache). Raises :class:`CredentialsError` when missing (404) or unreadable (403)."""
        try:
            if self.secrets is not None:
                found = await self.secrets(namespace, name)
            else:
                found = (await self.kube.get(Secret, name, namespace=namespace)).to_dict()
        except ApiError as e:
            if e.status.code == 403:
                raise CredentialsError(
                    f"credentials Secret {name!r} cannot be read (HTTP 403)"
                ) from None
            if e.status.code != 404:
                raise
            found = None
        if found is None:
            raise CredentialsError(f"credentials Secret {name!r} not found")
        return found

    def forget(self, namespace: str, secret: str) -> None:
        """Drop what is known of one Secret (its pool is gone, or it no longer holds
        credentials); its client is retired unless another Secret holds the same key."""
        seen = self._secrets.pop((namespace, secret), None)
        if seen is not None:
            self._release(seen.identity)

    def _release(self, identity: CredentialIdentity) -> None:
        """Retire the client of ``identity`` when no Secret names it any more."""
        if any(s.identity == identity for s in self._secrets.values()):
            return
        client = self._clients.pop(identity, None)
        if client is None:
            return
        if self.on_retire is not None:
            self.on_retire(client)
        task = asyncio.get_running_loop().create_task(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def identities(self) -> list[CredentialIdentity]:
        """The identities of the clients in use (no secret in them)."""
        return list(self._clients)

    async def close(self) -> None:
        """Close every client."""
        for c in self._clients.values():
            await c.close()
        for t in list(self._closing):
            await t
        self._clients.clear()
        self._secrets.clear()
