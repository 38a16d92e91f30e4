"""GitHub App and PAT credentials, the App JWT and the installation-token cache.

Source: GitHub docs, "Generating a JSON Web Token (JWT) for a GitHub App" (RS256; ``iat`` 60 s in
the past against clock drift; ``exp`` no more than 10 minutes in the future; ``iss`` = App ID) and
"Generating an installation access token for a GitHub App" (tokens expire after one hour; the
``permissions`` body restricts the token).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey
from pydantic import SecretStr

from impvm.github.errors import CredentialsError

#: Seconds the JWT ``iat`` is back-dated (GitHub's recommendation against clock drift).
JWT_IAT_SKEW = 60
#: JWT lifetime in seconds counted from ``iat``; GitHub allows at most 600.
JWT_LIFETIME = 540

#: Keys of the pool's credentials Secret (docs/architecture.md, fixed interfaces).
APP_ID_KEY = "github_app_id"
INSTALLATION_ID_KEY = "github_app_installation_id"
PRIVATE_KEY_KEY = "github_app_private_key"
PAT_KEY = "github_token"

Permissions = Mapping[str, str]
"""GitHub App permission name -> ``"read"`` | ``"write"`` (e.g. ``{"actions": "read"}``)."""


@dataclass(frozen=True)
class AppCredentials:
    """GitHub App credentials: numeric App ID, installation ID and the PEM private key.

    ``repr``/``str`` never show the key (pydantic ``SecretStr``)."""

    app_id: int
    installation_id: int
    private_key: SecretStr


@dataclass(frozen=True)
class PatCredentials:
    """A personal access token (``tokenSource: pat``); ``repr`` never shows it."""

    token: SecretStr


Credentials = AppCredentials | PatCredentials


@dataclass(frozen=True, slots=True)
class CredentialIdentity:
    """What makes two credentials the same, for sharing a client, its installation tokens and
    every cache kept for them. Never holds a secret: ``fingerprint`` is the SHA-256 of the App
    key's public half (DER SubjectPublicKeyInfo, base64: the fingerprint GitHub shows beside an
    App's private keys, "Managing private keys for GitHub Apps") or of the PAT (hex).

    ``api_url``: the REST base the credentials are used against; ``kind``: ``app`` or ``pat``;
    ``app_id``/``installation_id``: the App's, None for a PAT."""

    api_url: str
    kind: Literal["app", "pat"]
    fingerprint: str
    app_id: int | None = None
    installation_id: int | None = None

    @property
    def installation(self) -> str:
        """The key job routing groups credentials by: one App installation on one GitHub
        (``<api_url>#installation/<id>``), or, for a PAT, that token
        (``<api_url>#pat/<first 16 hex of its fingerprint>``)."""
        if self.kind == "app":
            return f"{self.api_url}#installation/{self.installation_id}"
        return f"{self.api_url}#pat/{self.fingerprint[:16]}"

    def __str__(self) -> str:
        if self.kind == "app":
            return (
                f"App {self.app_id} installation {self.installation_id} "
                f"key SHA256:{self.fingerprint}"
            )
        return f"PAT {self.fingerprint[:12]}"


def public_key_fingerprint(private_key_pem: str) -> str:
    """Base64 SHA-256 of the DER public key of a PEM RSA private key: what GitHub lists as the
    key's fingerprint (``openssl rsa -in KEY -pubout -outform DER | openssl sha256 -binary |
    openssl base64``, "Verifying private keys" in the GitHub docs). Raises
    :class:`CredentialsError`."""
    der = (
        load_private_key(private_key_pem)
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


def identity_of(credentials: Credentials, api_url: str) -> CredentialIdentity:
    """The :class:`CredentialIdentity` of ``credentials`` used against ``api_url``."""
    if isinstance(credentials, AppCredentials):
        return CredentialIdentity(
            api_url=api_url,
            kind="app",
            fingerprint=public_key_fingerprint(credentials.private_key.get_secret_value()),
            app_id=credentials.app_id,
            installation_id=credentials.installation_id,
        )
    digest = hashlib.sha256(credentials.token.get_secret_value().encode()).hexdigest()
    return CredentialIdentity(api_url=api_url, kind="pat", fingerprint=digest)


def _text(data: Mapping[str, str | bytes], key: str) -> str:
    value = data.get(key)
    if value is None:
        raise CredentialsError(f"credentials Secret lacks key {key!r}")
    text = value.decode() if isinstance(value, bytes) else value
    if not text.strip():
        raise CredentialsError(f"credentials Secret key {key!r} is empty")
    return text


def credentials_from_secret(
    data: Mapping[str, str | bytes],
    token_source: Literal["github_app", "pat"] = "github_app",  # noqa: S107
) -> Credentials:
    """Build credentials from the decoded ``data`` of the pool's credentials Secret.

    ``github_app``: keys ``github_app_id``, ``github_app_installation_id`` (integers) and
    ``github_app_private_key`` (PEM). ``pat``: key ``github_token``.
    Raises :class:`CredentialsError` naming the missing/invalid key (never its value).
    """
    if token_source == "pat":
        return PatCredentials(token=SecretStr(_text(data, PAT_KEY).strip()))
    ids: dict[str, int] = {}
    for key in (APP_ID_KEY, INSTALLATION_ID_KEY):
        raw = _text(data, key).strip()
        if not raw.isdigit():
            raise CredentialsError(f"credentials Secret key {key!r} is not a positive integer")
        ids[key] = int(raw)
    pem = _text(data, PRIVATE_KEY_KEY)
    load_private_key(pem)
    return AppCredentials(
        app_id=ids[APP_ID_KEY],
        installation_id=ids[INSTALLATION_ID_KEY],
        private_key=SecretStr(pem),
    )


@functools.lru_cache(maxsize=16)
def load_private_key(pem: str) -> RSAPrivateKey:
    """Parse a PEM RSA private key (PKCS#1 or PKCS#8). Raises :class:`CredentialsError`.

    Parsing validates the key (tens of milliseconds for RSA), so each key is parsed once and
    kept (by its PEM text, which the credentials hold in memory anyway); a failure is not
    kept."""
    try:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError):
        raise CredentialsError("github_app_private_key is not a PEM private key") from None
    if not isinstance(key, RSAPrivateKey):
        raise CredentialsError("github_app_private_key is not an RSA key (RS256 needs RSA)")
    return key


def create_app_jwt(app_id: int, private_key_pem: str, now: float | None = None) -> str:
    """Sign the App JWT: RS256, ``iat`` = now - 60 s, ``exp`` = ``iat`` + 540 s (so at most
    10 minutes after ``iat``), ``iss`` = App ID as a string. ``now`` is epoch seconds.

    Source: GitHub docs, "Generating a JSON Web Token (JWT) for a GitHub App".
    Raises :class:`CredentialsError` if the key cannot be used."""
    issued = int(now if now is not None else time.time()) - JWT_IAT_SKEW
    claims = {"iat": issued, "exp": issued + JWT_LIFETIME, "iss": str(app_id)}
    return jwt.encode(claims, load_private_key(private_key_pem), algorithm="RS256")


def permissions_key(permissions: Permissions | None) -> tuple[tuple[str, str], ...]:
    """Canonical, hashable form of a permission set (sorted ``(name, level)`` pairs)."""
    return tuple(sorted((permissions or {}).items()))


@dataclass
class CachedToken:
    """An installation token and its expiry (epoch seconds)."""

    token: SecretStr
    expires_at: float


@dataclass
class TokenCache:
    """Installation tokens keyed by (installation id, permission set).

    A token is reused until ``refresh_margin`` seconds before its ``expires_at``; then the
    caller mints a new one. Times are epoch seconds from the client's clock."""

    refresh_margin: float = 300.0
    _tokens: dict[tuple[int, tuple[tuple[str, str], ...]], CachedToken] = field(
        default_factory=dict
    )

    def get(
        self, installation_id: int, permissions: Permissions | None, now: float
    ) -> SecretStr | None:
        """The cached token if still fresh at ``now``, else ``None``."""
        entry = self._tokens.get((installation_id, permissions_key(permissions)))
        if entry is None or now >= entry.expires_at - self.refresh_margin:
            return None
        return entry.token

    def put(
        self,
        installation_id: int,
        permissions: Permissions | None,
        token: SecretStr,
        expires_at: float,
    ) -> None:
        """Store a freshly minted token."""
        self._tokens[(installation_id, permissions_key(permissions))] = CachedToken(
            token, expires_at
        )

    def drop(self, installation_id: int, permissions: Permissions | None) -> None:
        """Forget a token (e.g. after a 401 on a call)."""
        self._tokens.pop((installation_id, permissions_key(permissions)), None)

    def secrets(self) -> list[str]:
        """All cached token values (for redaction of error texts)."""
        return [entry.token.get_secret_value() for entry in self._tokens.values()]
