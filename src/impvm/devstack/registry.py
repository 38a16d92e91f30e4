"""A local OCI registry for tests and the embedded stack: Debian's ``docker-registry`` (CNCF
distribution 2.x, package ``docker-registry``) serving plain HTTP on a free loopback port, with its
storage in a temporary directory.

Usage::

    async with LocalRegistry() as reg:
        reg.address          # "127.0.0.1:PORT" (use with skopeo --dest/src-tls-verify=false)

Clients must treat it as an insecure (HTTP) registry; it is only ever bound to loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

DEFAULT_BINARY = Path("/usr/bin/docker-registry")

_CONFIG = """\
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: {host}:{port}
health:
  storagedriver:
    enabled: false
"""


class RegistryError(Exception):
    """The registry could not be started (binary missing, did not become ready in time)."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class LocalRegistry:
    """One ``docker-registry serve CONFIG`` process on ``host`` (loopback) and a free port.

    ``storage_dir``: where blobs live; a fresh temporary directory (removed by :meth:`stop`) when
    not given. ``binary``: the registry executable (Debian: ``/usr/bin/docker-registry``).
    ``tls``: ``(certificate, key, CA)`` files to serve HTTPS with (the test cluster's registry,
    which pods reach on a non-loopback address); plain HTTP without.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        storage_dir: Path | None = None,
        binary: Path = DEFAULT_BINARY,
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.binary = binary
        self._own_dir = storage_dir is None
        self._dir = storage_dir
        self._proc: asyncio.subprocess.Process | None = None
        self._log: Path | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """``host:port`` of the running registry (the registry part of an image reference)."""
        if self._proc is None:
            raise RegistryError("registry is not running")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The registry process's id while it runs."""
        return self._proc.pid if self._proc is not None else None

    async def start(self, ready_seconds: float = 30.0) -> str:
        """Start the registry and wait (up to ``ready_seconds``) until ``GET /v2/`` answers 200.

        Returns :attr:`address`. Raises :class:`RegistryError` when the binary is missing or the
        registry does not become ready (the message carries the registry's log tail).
        """
        if self._proc is not None:
            return self.address
        if not self.binary.exists():
            raise RegistryError(
                f"{self.binary} not found (install the Debian package docker-registry)"
            )
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="impvm-registry-"))
        storage = self._dir / "storage"
        storage.mkdir(parents=True, exist_ok=True)
        self.port = _free_port(self.host)
        config = self._dir / "config.yml"
        text = _CONFIG.format(root=storage, host=self.host, port=self.port)
        if self.tls is not None:
            addr = f"  addr: {self.host}:{self.port}\n"
            tls = f"  tls:\n    certificate: {self.tls[0]}\n    key: {self.tls[1]}\n"
            text = text.replace(addr, addr + tls)
        config.write_text(text)
        self._log = self._dir / "registry.log"
        with self._log.open("ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                str(self.binary),
                "serve",
                str(config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + ready_seconds
        scheme = "https" if self.tls else "http"
        verify: str | bool = str(self.tls[2]) if self.tls else True
        async with httpx.AsyncClient(timeout=2.0, verify=verify) as client:
            while True:
                if self._proc.returncode is not None:
                    break
                with contextlib.suppress(httpx.HTTPError):
                    resp = await client.get(f"{scheme}://{self.host}:{self.port}/v2/")
                    if resp.status_code == 200:
                        return self.address
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        tail = self._log.read_text(errors="replace")[-2000:]
        await self.stop()
        raise RegistryError(f"docker-registry did not become ready: {tail}")

    async def stop(self) -> None:
        """Stop the registry (SIGTERM, SIGKILL after 5 s) and remove a temporary storage dir.
        Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._own_dir and self._dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._dir, True)
            self._dir = None

    async def __aenter__(self) -> LocalRegistry:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
