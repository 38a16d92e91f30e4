"""One source of GitHub credentials and clients for the whole operator.

The pool pass, the reaper and pool teardown all ask :class:`GitHubProvider` for a pool's client.
It reads the pool's credentials Secret (``spec.platform.credentialsSecret`` in the pool's
namespace; keys as in docs/architecture.md), parses it only when its ``resourceVersion`` changed
(the App key is parsed once), and hands out one :class:`GitHubClient` per installation (per PAT):
one token cache, one ETag cache and one connection pool, shared by every pool and the reaper of
that installation. A rotated key keeps the installation's client and its cached tokens.

GitHub rate limits are never waited for inside a request here: the client raises
:class:`~impvm.github.errors.RateLimited` and the pass decides (condition at once, retry after
the reset).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret

from impvm.api.models import Platform
from impvm.github import (
    AppCredentials,
    GitHubClient,
    RetryPolicy,
    Scope,
    api_base_url,
    credentials_from_secret,
)
from impvm.github.errors import CredentialsError

#: ``(namespace, name) -> Secret as a dict, or None when missing`` (may raise ``ApiError``).
SecretReader = Callable[[str, str], Awaitable[dict[str, Any] | None]]


def scope_of(platform: Platform) -> Scope:
    """The GitHub scope (org or repository) of a pool's ``spec.platform``."""
    return Scope(org=platform.scope.org, repo=platform.scope.repo)


@dataclass(frozen=True)
class _SecretSeen:
    fingerprint: tuple[str, str | None, str]  # resourceVersion, serverURL, tokenSource
    client: Hashable


class GitHubProvider:
    """Clients for pools' credentials Secrets, one per installation.

    ``api_url`` overrides the REST base of every pool (the stand-in); ``timeout`` is seconds
    per request; ``retry`` bounds transient retries (rate limits are never waited for)."""

    def __init__(
        self,
        kube: AsyncClient,
        *,
        api_url: str | None = None,
        timeout: float = 15.0,
        retry: RetryPolicy | None = None,
        secrets: SecretReader | None = None,
    ) -> None:
        self.kube = kube
        self.secrets = secrets
        self.api_url = api_url
        self.timeout = timeout
        self.retry = dataclasses.replace(retry or RetryPolicy(), max_rate_limit_retries=0)
        self._clients: dict[Hashable, GitHubClient] = {}
        self._secrets: dict[tuple[str, str], _SecretSeen] = {}

    async def client(self, namespace: str, platform: Platform) -> GitHubClient:
        """The client for the credentials Secret a pool in ``namespace`` names.

        Raises :class:`CredentialsError` when the Secret is missing (404), unreadable (403) or
        lacks a key; the message names the Secret and the key, never a value."""
        name = platform.credentials_secret
        sec = await self._read(namespace, name)
        version = str((sec.get("metadata") or {}).get("resourceVersion") or "")
        fingerprint = (version, platform.server_url, platform.token_source)
        seen = self._secrets.get((namespace, name))
        if seen is not None and seen.fingerprint == fingerprint and seen.client in self._clients:
            return self._clients[seen.client]
        data = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
        creds = credentials_from_secret(data, platform.token_source)
        base = self.api_url or api_base_url(platform.server_url)
        if isinstance(creds, AppCredentials):
            key: Hashable = (base, "app", creds.app_id, creds.installation_id)
        else:
            digest = hashlib.sha256(creds.token.get_secret_value().encode()).hexdigest()
            key = (base, "pat", digest)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = GitHubClient(
                creds, api_url=base, timeout=self.timeout, retry=self.retry
            )
        else:
            client.use_credentials(creds)
        self._secrets[(namespace, name)] = _SecretSeen(fingerprint, key)
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
        """Drop what is known of one Secret (its pool is gone); the installation's client stays
        for the other pools."""
        self._secrets.pop((namespace, secret), None)

    async def close(self) -> None:
        """Close every client."""
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        self._secrets.clear()
