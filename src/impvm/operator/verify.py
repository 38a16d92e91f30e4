"""The public key a template's VMs must be signed by: read by the operator from the Secret named
in ``ImpVMTemplate.spec.verify.publicKeySecretRef`` and copied onto each new VM as
``ImpVM.spec.verify.publicKey``, so the node agent verifies against the VM's own spec and never
needs to read a Secret other than its VMs' JIT configs (docs/signing.md)."""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import serialization

from impvm.api.models import (
    PUBLIC_KEY_PEM_PATTERN,
    VERIFY_PUBLIC_KEY_MAX_LENGTH,
    ImpVMTemplateSpec,
)
from impvm.scaling.poolpass.world import VerifyKey
from impvm.signing.keys import key_fingerprint

_PEM = re.compile(PUBLIC_KEY_PEM_PATTERN)


class VerifyKeyError(Exception):
    """The template requires signatures but its public key cannot be used: the Secret or its key
    is missing, or the value is not one PEM public key. The message names the template, the
    Secret and the key (the value is not secret, but is not repeated either)."""


def secret_of(template: ImpVMTemplateSpec) -> str | None:
    """Name of the Secret holding the template's public key (None: no signatures required)."""
    return template.verify.public_key_secret_ref.name if template.verify else None


def verify_key(
    namespace: str, template: ImpVMTemplateSpec, secret: Mapping[str, Any] | None
) -> VerifyKey | None:
    """The public key new VMs of ``template`` (in ``namespace``) must be verified with, from
    ``secret`` (the body of the Secret :func:`secret_of` names, None when it does not exist), or
    None when the template does not ask for signatures. Raises :class:`VerifyKeyError`; a VM
    must then not be created (it would boot unverified images)."""
    verify = template.verify
    if verify is None:
        return None
    ref = verify.public_key_secret_ref
    where = (
        f"verify.publicKeySecretRef of the template: Secret {namespace}/{ref.name} key {ref.key}"
    )
    if secret is None:
        raise VerifyKeyError(f"{where}: Secret not found")
    raw = (secret.get("data") or {}).get(ref.key)
    if raw is None:
        raise VerifyKeyError(f"{where}: the Secret has no such key")
    try:
        pem = base64.b64decode(raw).decode()
        if len(pem) > VERIFY_PUBLIC_KEY_MAX_LENGTH or not _PEM.match(pem):
            raise ValueError("not one PEM PUBLIC KEY block")
        serialization.load_pem_public_key(pem.encode())
        fingerprint = key_fingerprint(pem)[0]
    except ValueError as e:  # UnicodeDecodeError and binascii.Error are ValueErrors
        raise VerifyKeyError(f"{where}: not a PEM public key ({e})") from None
    return VerifyKey(pem=pem, fingerprint=fingerprint)
