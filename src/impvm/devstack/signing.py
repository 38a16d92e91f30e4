"""Signing images for tests and the embedded stack, the way a user's CI does (docs/signing.md):
``cosign generate-key-pair`` makes the key pair and ``cosign sign --key`` writes a sigstore
signature next to the image in the registry, as the ``REPO:sha256-<digest>.sig`` attachment the
agent's ``cosign verify`` reads (:mod:`impvm.agent.signing`).

cosign is built once from its Go module (:mod:`impvm.signing.cosign`, cached under
``~/.cache/impvm/cosign/<version>``; scripts/setup.sh builds it).

Example::

    key = await generate_key_pair(tmp_path / "keys")
    await sign_image(key, "127.0.0.1:5000/imp/runner-base@sha256:...", insecure=True)
    key.public_key_pem          # what goes into the template's public-key Secret
"""

from __future__ import annotations

import asyncio
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from impvm.signing.cosign import SigningError, cosign_binary


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, 0o600)


@dataclass(frozen=True)
class SigningKey:
    """A cosign key pair on disk: ``private_key`` (``cosign.key``, encrypted with the password in
    ``password_file``), ``public_key`` (``cosign.pub``) and its PEM text."""

    private_key: Path
    public_key: Path
    password_file: Path = field(repr=False)

    @property
    def public_key_pem(self) -> str:
        """The PEM public key (not secret: it goes into a template's Secret and VM specs)."""
        return self.public_key.read_text()

    @property
    def password(self) -> str:
        """The private key's password (cosign's ``COSIGN_PASSWORD``)."""
        return self.password_file.read_text()


async def generate_key_pair(directory: Path, cosign: Path | None = None) -> SigningKey:
    """``cosign generate-key-pair`` into ``directory`` (created 0700) with a random password.
    Raises :class:`SigningError`."""
    password = secrets.token_urlsafe(24)
    pw = directory / "password"
    await asyncio.to_thread(_write_private, pw, password)
    binary = cosign or await asyncio.to_thread(cosign_binary)
    proc = await asyncio.create_subprocess_exec(
        str(binary),
        "generate-key-pair",
        "--output-key-prefix",
        str(directory / "cosign"),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COSIGN_PASSWORD": password},
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SigningError(f"cosign generate-key-pair failed: {err.decode(errors='replace')}")
    return SigningKey(directory / "cosign.key", directory / "cosign.pub", pw)


async def sign_image(
    key: SigningKey, pinned: str, *, insecure: bool = False, cosign: Path | None = None
) -> None:
    """Sign ``pinned`` (``REPO@sha256:...``) with ``cosign sign --key``, without a
    transparency-log upload (the registry attachment is what the agent checks). ``insecure``:
    plain-HTTP (loopback) registry. Raises :class:`SigningError`."""
    binary = cosign or await asyncio.to_thread(cosign_binary)
    args = [str(binary), "sign", "--yes", "--tlog-upload=false", "--key", str(key.private_key)]
    if insecure:
        args += ["--allow-insecure-registry", "--allow-http-registry"]
    proc = await asyncio.create_subprocess_exec(
        *args,
        pinned,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COSIGN_PASSWORD": key.password},
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SigningError(f"cosign sign {pinned} failed: {err.decode(errors='replace')[-2000:]}")
