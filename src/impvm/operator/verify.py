"""The public key a template's VMs must be signed by: read by the operator from the Secret named
in ``ImpVMTemplate.spec.verify.publicKeySecretRef`` and copied onto each new VM as
``ImpVM.spec.verify.publicKey``, so the node agent verifies against the VM's own spec and never
needs to read a Secret other than its VMs' JIT configs (docs/signing.md)."""

from __future__ import annotations

import base64
import re

from cryptography.hazmat.primitives import serialization
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret

from impvm.api.models import (
    PUBLIC_KEY_PEM_PATTERN,
    VERIFY_PUBLIC_KEY_MAX_LENGTH,
    ImpVMTemplate,
)

_PEM = re.compile(PUBLIC_KEY_PEM_PATTERN)


class VerifyKeyError(Exception):
    """The template requires signatures but its public key cannot be used: the Secret or its key
    is missing, or the value is not one PEM public key. The message names the template, the
    Secret and the key (the value is not secret, but is not repeated either)."""


async def read_verify_key(kube: AsyncClient, namespace: str, template: ImpVMTemplate) -> str | None:
    """The PEM public key new VMs of ``template`` (in ``namespace``) must be verified with, or
    None when the template does not ask for signatures. Raises :class:`VerifyKeyError`; a VM
    must then not be created (it would boot unverified images), and ApiError for API failures
    other than 404."""
    verify = template.spec.verify
    if verify is None:
        return None
    ref = verify.public_key_secret_ref
    where = (
        f"verify.publicKeySecretRef of the template: Secret {namespace}/{ref.name} key {ref.key}"
    )
    try:
        sec = await kube.get(Secret, ref.name, namespace=namespace)
    except ApiError as e:
        if e.status.code != 404:
            raise
        raise VerifyKeyError(f"{where}: Secret not found") from None
    raw = (sec.data or {}).get(ref.key)
    if raw is None:
        raise VerifyKeyError(f"{where}: the Secret has no such key")
    try:
        pem = base64.b64decode(raw).decode()
        if len(pem) > VERIFY_PUBLIC_KEY_MAX_LENGTH or not _PEM.match(pem):
            raise ValueError("not one PEM PUBLIC KEY block")
        serialization.load_pem_public_key(pem.encode())
    except ValueError as e:  # UnicodeDecodeError and binascii.Error are ValueErrors
        raise VerifyKeyError(f"{where}: not a PEM public key ({e})") from None
    return pem
