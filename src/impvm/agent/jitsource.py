"""Where an agent obtains a VM's JIT config at launch (and nowhere else).

:class:`OperatorJitSource` asks the operator's hand-out
(:mod:`impvm.operator.jithandout`) with a node-bound ServiceAccount token read from a file at
every request (the kubelet rotates a projected token in place; ``impvm up`` rewrites its file).
The agent itself holds no right to read Secrets.

:class:`SecretJitSource` reads the VM's Secret through a Kubernetes client: for an in-process
agent whose client may read that Secret (tests acting as cluster admin), never for a node.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import httpx
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret as K8sSecret

from impvm.agent.runtime import Secret
from impvm.api.models import JIT_HANDOUT_PATH, JIT_SECRET_KEY

log = logging.getLogger("impvm.agent.jit")


class JitSourceError(Exception):
    """The JIT config could not be asked for (the operator is unreachable or answered with an
    error other than "not there yet"). The message never carries the value or the token."""


class JitSource(Protocol):
    """``await source.jitconfig(namespace, name, secret_name)``: the JIT config of VM
    ``namespace/name`` whose Secret is ``secret_name``; None while it is not there (yet).
    Raises :class:`JitSourceError` when it cannot tell."""

    async def jitconfig(self, namespace: str, name: str, secret_name: str) -> Secret | None: ...

    async def close(self) -> None: ...


class OperatorJitSource:
    """The operator's hand-out at ``base_url`` (e.g. ``http://impvm-operator.impvm-system:8080``),
    authenticated with the token in ``token_file``. ``timeout`` in seconds."""

    def __init__(self, base_url: str, token_file: Path, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token_file = token_file
        self._http = httpx.AsyncClient(timeout=timeout)

    async def jitconfig(self, namespace: str, name: str, secret_name: str) -> Secret | None:
        try:
            token = self.token_file.read_text().strip()
        except OSError as e:
            raise JitSourceError(f"agent token {self.token_file}: {e.strerror}") from None
        path = JIT_HANDOUT_PATH.format(
            namespace=quote(namespace, safe=""), name=quote(name, safe="")
        )
        try:
            resp = await self._http.get(
                self.base_url + path, headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError as e:
            raise JitSourceError(f"JIT config hand-out: {type(e).__name__}") from None
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            try:
                why = str(resp.json().get("message", ""))
            except ValueError:
                why = ""
            raise JitSourceError(f"JIT config hand-out answered {resp.status_code}: {why}")
        value = resp.json().get("jitconfig")
        if not isinstance(value, str) or not value:
            return None
        return Secret(value)

    async def close(self) -> None:
        await self._http.aclose()


class SecretJitSource:
    """Reads the VM's JIT Secret with ``client`` (which must be allowed to)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def jitconfig(self, namespace: str, name: str, secret_name: str) -> Secret | None:
        try:
            sec = await self.client.get(K8sSecret, secret_name, namespace=namespace)
        except ApiError as e:
            if e.status.code in (403, 404):
                return None
            raise
        data = (sec.data or {}).get(JIT_SECRET_KEY)
        if not data:
            return None
        return Secret(base64.b64decode(data).decode())

    async def close(self) -> None:
        return None
