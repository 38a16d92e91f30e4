"""Public keys of image signatures, named the way the agent's verdicts and the operator's
template check name them: ``sha256:<hex>`` of the key's DER SubjectPublicKeyInfo.

Example::

    key_fingerprint(open("cosign.pub").read())[0]   # 'sha256:3f1c...'
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives import serialization


def key_fingerprint(pem: str) -> tuple[str, bytes]:
    """``(sha256:<hex> of the DER SubjectPublicKeyInfo, normalised PEM bytes)`` of a PEM public
    key. Raises ValueError when ``pem`` is not a public key (cryptography's parser)."""
    key = serialization.load_pem_public_key(pem.encode())
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    normalised = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(der).hexdigest(), normalised
