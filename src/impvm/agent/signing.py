"""Signed images: sigstore signatures checked by ``cosign verify`` before each digest-pinned pull.

A VM whose spec carries ``verify.publicKey`` (copied by the operator from its template's
``verify.publicKeySecretRef``) boots only from an image and a runner layer that each carry a
sigstore signature by that key for their manifest digest: the ``REPO:sha256-<digest>.sig``
attachment that ``cosign sign --key`` writes (sigstore's "simple signing" payload, whose
``critical.image.docker-manifest-digest`` names the signed manifest).

The verdict is cosign's, never ours: the image store runs, for each of the two references,

    cosign verify --key KEY --insecure-ignore-tlog=true --trusted-root EMPTY REPO@DIGEST

and pulls ``REPO@DIGEST`` with skopeo only when it exits 0. Both name the same digest, which the
store has already checked against the raw manifest, and skopeo verifies every blob against it,
so what is unpacked is what was verified. No transparency log and no TUF root are consulted
(``--insecure-ignore-tlog`` with an empty trusted root): trust is the key alone, so nodes
without internet access verify the same way, and nothing but the registry is contacted.

Why cosign and not skopeo's containers-policy ``sigstoreSigned``: Debian 12's skopeo 1.9.3 (and
every Debian build of containers/image) is compiled with sigstore disabled; it refuses every
signed image with "Debian-local change: sigstore disabled". cosign is sigstore's own verifier,
built from its Go module and pinned (:mod:`impvm.signing.cosign`).

This module chooses the files and turns cosign's exit status (cosign's documented exit codes:
10 no signature, 12 no matching signature) into a reason a person can act on:

=======================  =============================  =======================================
reason                   cosign says                    what happened
=======================  =============================  =======================================
ImageUnsigned            exit 10 "no signatures found"  no signature at all
ImageWrongKey            exit 12 "invalid signature     signed by another key, or the signature
                         when validating ..."           bytes were altered
ImageTampered            exit 12 "invalid or missing    a signature by the key, but of other
                         digest in claim"               content (its payload names another
                                                        digest: the image changed after signing)
ImageSignatureRejected   exit 12, any other reason      no usable signature
VerifierUnavailable      cosign missing or failing      the node cannot verify: fail closed
=======================  =============================  =======================================
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from impvm.agent.runtime import ImageError, Verification, VMRequest
from impvm.signing.keys import key_fingerprint

#: Condition type on ImpVM.status a signature check reports in (Kubernetes API conventions).
CONDITION_TYPE = "ImageVerified"

UNSIGNED = "ImageUnsigned"
WRONG_KEY = "ImageWrongKey"
TAMPERED = "ImageTampered"
REJECTED = "ImageSignatureRejected"
VERIFIER_UNAVAILABLE = "VerifierUnavailable"
KEY_INVALID = "VerifyKeyInvalid"
VERIFIED = "Verified"

#: cosign's exit codes (cmd/cosign/errors/exit_codes.go)
COSIGN_NO_SIGNATURE = 10
COSIGN_NO_MATCHING_SIGNATURE = 12

#: A trusted root with no transparency log, CA or timestamp authority: key-only verification
#: without cosign fetching sigstore's public TUF root over the network.
_EMPTY_TRUSTED_ROOT = (
    b'{"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1"}\n'
)


def classify_refusal(exit_code: int, output: str) -> tuple[str, str] | None:
    """``(reason, explanation)`` of a failed ``cosign verify``, or None when cosign failed for a
    reason that says nothing about the signatures (registry unreachable, bad flags).

    ``output``: cosign's stderr."""
    if exit_code == COSIGN_NO_SIGNATURE:
        return UNSIGNED, "has no signature"
    if exit_code != COSIGN_NO_MATCHING_SIGNATURE:
        return None
    text = output.lower()
    if "invalid or missing digest in claim" in text:
        return (
            TAMPERED,
            "has a signature by the required key, but for other content (tampered: the "
            "image is not the one that was signed)",
        )
    if "invalid signature when validating" in text:
        return (
            WRONG_KEY,
            "has no signature that verifies with the required key (signed by another key, "
            "or the signature was altered)",
        )
    return REJECTED, "has no signature the required key accepts"


class SignatureError(ImageError):
    """An image or runner layer was refused because it lacks a valid signature by the required
    key, or the node cannot check. ``reason``: one of the module's reasons; ``image``: the
    refused reference; ``role``: ``image`` or ``runner layer``; ``key_fingerprint``:
    ``sha256:<hex>`` of the key (or "")."""

    def __init__(
        self, reason: str, role: str, image: str, message: str, key_fingerprint: str = ""
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.role = role
        self.image = image
        self.key_fingerprint = key_fingerprint


def _write_once(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically unless it already holds exactly that."""
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@dataclass(frozen=True)
class TrustKey:
    """One verification key on disk: ``fingerprint`` (``sha256:<hex>`` of its DER
    SubjectPublicKeyInfo; names the key in messages and cache keys) and ``path`` (its PEM)."""

    fingerprint: str
    path: Path


class Verifier:
    """Runs ``cosign verify`` (binary ``cosign``) with keys kept under ``root``
    (``<root>/keys/<hex>.pub``; cosign's home, TUF cache and the empty trusted root beside)."""

    def __init__(self, root: Path, cosign: str = "cosign") -> None:
        self.root = root
        self.cosign = cosign
        self._keys: dict[str, TrustKey] = {}

    def key_for(self, public_key: str, role: str = "image", image: str = "") -> TrustKey:
        """The :class:`TrustKey` of ``public_key`` (PEM), writing its file if needed. Raises
        :class:`SignatureError` (VerifyKeyInvalid, naming ``image``) for a PEM without a key."""
        try:
            fingerprint, pem = key_fingerprint(public_key)
        except ValueError as e:
            raise SignatureError(
                KEY_INVALID,
                role,
                image,
                f"verify.publicKey of the VM is not a usable public key, so {role} {image} "
                f"cannot be verified: {e}",
            ) from e
        known = self._keys.get(fingerprint)
        if known is not None and known.path.exists():
            return known
        for d in (self.root, self.root / "keys", self.root / "home"):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.root / "keys" / f"{fingerprint.partition(':')[2]}.pub"
        _write_once(path, pem)
        _write_once(self.root / "trusted-root.json", _EMPTY_TRUSTED_ROOT)
        self._keys[fingerprint] = key = TrustKey(fingerprint, path)
        return key

    async def verify(
        self,
        key: TrustKey,
        role: str,
        pinned: str,
        *,
        insecure: bool = False,
        auth_file: Path | None = None,
    ) -> None:
        """Verify that ``pinned`` (``REPO@sha256:...``; ``role``: ``image`` or ``runner
        layer``) has a sigstore signature by ``key`` for its digest. ``insecure``: the registry
        is plain HTTP (loopback); ``auth_file``: docker-config-style credentials. Raises
        :class:`SignatureError` with the reason; returns when cosign accepted."""
        args = [
            self.cosign,
            "verify",
            "--key",
            str(key.path),
            "--insecure-ignore-tlog=true",
            "--trusted-root",
            str(self.root / "trusted-root.json"),
            "--output",
            "json",
        ]
        if insecure:
            args += ["--allow-insecure-registry", "--allow-http-registry"]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root / "home"),  # no ~/.docker or ~/.sigstore of the agent's user
            "TUF_ROOT": str(self.root / "home" / "tuf"),
        }
        if auth_file is not None:
            env["REGISTRY_AUTH_FILE"] = str(auth_file)
        try:
            proc = await asyncio.create_subprocess_exec(
                *args,
                "--",  # the reference is never an option, whatever it looks like
                pinned,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
        except OSError as e:
            raise SignatureError(
                VERIFIER_UNAVAILABLE,
                role,
                pinned,
                f"{role} {pinned} cannot be verified: cosign ({self.cosign}) cannot run on "
                f"this node: {e}",
                key.fingerprint,
            ) from e
        _, err = await proc.communicate()
        if proc.returncode == 0:
            return
        output = err.decode(errors="replace").strip()
        detail = output.splitlines()[-1][-600:] if output else f"exit {proc.returncode}"
        found = classify_refusal(proc.returncode or 0, output)
        if found is None:
            reason, explanation = VERIFIER_UNAVAILABLE, "could not be verified"
        else:
            reason, explanation = found
        raise SignatureError(
            reason,
            role,
            pinned,
            f"{role} {pinned} {explanation}; required key {key.fingerprint} (cosign: {detail})",
            key.fingerprint,
        )


def verification(req: VMRequest, err: SignatureError | None = None) -> Verification | None:
    """The outcome of the signature check of ``req`` for its ``ImageVerified`` condition: None
    when the VM requires no signature; refused with ``err.reason`` and a message naming the
    refused image when ``err`` is given; else verified, naming the image(s) and the key."""
    if err is None and not req.verify_public_key:
        return None
    if err is not None:
        return Verification(False, err.reason, str(err)[:1024])
    assert req.verify_public_key is not None
    fingerprint = key_fingerprint(req.verify_public_key)[0]
    images = [f"image {req.image}"]
    if req.runner_layer:
        images.append(f"runner layer {req.runner_layer}")
    return Verification(
        True, VERIFIED, f"{' and '.join(images)} signed by key {fingerprint}"[:1024]
    )
