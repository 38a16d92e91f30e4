"""Signed images only: keys made by ``cosign generate-key-pair``, signatures made by ``cosign
sign`` into the loopback registry, verified by the image store through ``cosign verify`` before
each pull. Unsigned, foreign-key, tampered and altered images and runner layers are refused with
the reason and the image named; a correctly signed pair is prepared and boots."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from impvm.agent.images import ImageStore, parse_reference
from impvm.agent.process import ProcessRuntime
from impvm.agent.runtime import Secret, VMRequest
from impvm.agent.signing import (
    TAMPERED,
    UNSIGNED,
    VERIFIER_UNAVAILABLE,
    WRONG_KEY,
    SignatureError,
    classify_refusal,
    verification,
)
from impvm.agent.tools import run_tool
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.signing import SigningKey, generate_key_pair, sign_image
from impvm.devstack.testimages import build_runner_layer_image
from impvm.signing.cosign import SigningError, cosign_binary
from impvm.signing.keys import key_fingerprint
from tests.runtime_fixtures import Images

_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_SIG_ANNOTATION = "dev.cosignproject.cosign/signature"
OK_RUN_SH = "#!/bin/sh\necho signed-and-booted\nexit 0\n"


@pytest.fixture(scope="session")
def cosign() -> Path:
    try:
        return cosign_binary(build=False)
    except SigningError as e:  # scripts/setup.sh builds it: missing means a broken setup
        pytest.fail(str(e), pytrace=False)


@dataclass(frozen=True)
class Signed:
    """Pinned references in repositories ``sig/<case>-base`` and ``sig/<case>-layer`` for each
    case: good (signed by key ``a``), unsigned, otherkey (signed by ``b``), tampered (another
    image carrying a copy of a good signature) and altered (a good signature with one bit
    flipped)."""

    a: SigningKey
    b: SigningKey
    refs: dict[tuple[str, str], str]

    def ref(self, case: str, role: str) -> str:
        return self.refs[(case, role)]


async def _copy(src: str, dest: str) -> None:
    await run_tool(
        f"copying {src}",
        "skopeo",
        "--insecure-policy",
        "copy",
        "--quiet",
        "--preserve-digests",
        "--src-tls-verify=false",
        "--dest-tls-verify=false",
        f"docker://{src}",
        f"docker://{dest}",
    )


def _sig_url(registry: str, repo: str, digest: str) -> str:
    return f"http://{registry}/v2/{repo}/manifests/{digest.replace(':', '-')}.sig"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def signed(
    registry: LocalRegistry, images: Images, cosign: Path, tmp_path_factory: pytest.TempPathFactory
) -> Signed:
    work = tmp_path_factory.mktemp("signing")
    reg = registry.address
    a = await generate_key_pair(work / "a", cosign)
    b = await generate_key_pair(work / "b", cosign)
    ok_layer = await build_runner_layer_image(work / "ok", reg, run_sh=OK_RUN_SH, tag="ok")
    sources = {"base": images.base, "layer": ok_layer}
    # the content an attacker puts in place of the signed one (another image, another digest)
    substitutes = {"base": images.probe, "layer": images.sleep}
    refs: dict[tuple[str, str], str] = {}
    async with httpx.AsyncClient() as http:
        for role, src in sources.items():
            digest = parse_reference(src).digest
            assert digest is not None
            for case in ("good", "unsigned", "otherkey", "tampered", "altered"):
                repo = f"sig/{case}-{role}"
                await _copy(src, f"{reg}/{repo}:t")
                refs[(case, role)] = f"{reg}/{repo}@{digest}"
                if case != "unsigned":
                    await sign_image(
                        b if case == "otherkey" else a,
                        refs[(case, role)],
                        insecure=True,
                        cosign=cosign,
                    )
            # tampered: the substitute, with the good signature's attachment copied onto it
            repo = f"sig/tampered-{role}"
            sub = substitutes[role]
            sub_digest = parse_reference(sub).digest
            assert sub_digest is not None
            await _copy(sub, f"{reg}/{repo}:substitute")
            sig = await http.get(_sig_url(reg, repo, digest), headers={"Accept": _OCI_MANIFEST})
            sig.raise_for_status()
            put = await http.put(
                _sig_url(reg, repo, sub_digest),
                content=sig.content,
                headers={"Content-Type": _OCI_MANIFEST},
            )
            assert put.status_code == 201, put.text
            refs[("tampered", role)] = f"{reg}/{repo}@{sub_digest}"
            # altered: one bit of the good signature flipped
            repo = f"sig/altered-{role}"
            sig = await http.get(_sig_url(reg, repo, digest), headers={"Accept": _OCI_MANIFEST})
            manifest = sig.json()
            raw = bytearray(base64.b64decode(manifest["layers"][0]["annotations"][_SIG_ANNOTATION]))
            raw[-1] ^= 1
            manifest["layers"][0]["annotations"][_SIG_ANNOTATION] = base64.b64encode(raw).decode()
            put = await http.put(
                _sig_url(reg, repo, digest),
                content=json.dumps(manifest).encode(),
                headers={"Content-Type": _OCI_MANIFEST},
            )
            assert put.status_code == 201, put.text
    return Signed(a=a, b=b, refs=refs)


def _store(tmp_path: Path, registry: LocalRegistry, cosign: Path) -> ImageStore:
    return ImageStore(tmp_path / "cache", 1 << 30, {registry.address}, cosign=str(cosign))


def _cache_is_empty(tmp_path: Path) -> bool:
    return not any((tmp_path / "cache/images").iterdir()) and not any(
        (tmp_path / "cache/tmp").iterdir()
    )


async def test_signed_image_and_layer_are_verified_prepared_and_boot(
    tmp_path: Path, registry: LocalRegistry, cosign: Path, signed: Signed
) -> None:
    store = _store(tmp_path, registry, cosign)
    base, layer = signed.ref("good", "base"), signed.ref("good", "layer")
    fingerprint = key_fingerprint(signed.a.public_key_pem)[0]
    prepared = await store.prepare(base, layer, public_key=signed.a.public_key_pem)
    assert prepared.verified_by == fingerprint
    assert (prepared.rootfs / "home/runner/actions-runner/run.sh").read_text() == OK_RUN_SH

    req = _request(base, layer, signed.a.public_key_pem, tmp_path / "vms" / "signed")
    runtime = ProcessRuntime(store)
    await runtime.prepare(req)
    assert store.builds == 1  # the runtime got the entry verified above
    await runtime.start(req, Secret("jit"))
    for _ in range(300):
        state = await runtime.inspect(req)
        if state.status == "exited":
            break
        await asyncio.sleep(0.05)
    assert (state.status, state.exit_code) == ("exited", 0), state
    assert "signed-and-booted" in state.log_tail
    await runtime.cleanup(req)

    v = verification(req)
    assert v is not None and (v.verified, v.reason) == (True, "Verified")
    assert base in v.message and layer in v.message and fingerprint in v.message


# (case, reason, what cosign itself reported)
REFUSALS = [
    ("unsigned", UNSIGNED, "no signatures found"),
    ("otherkey", WRONG_KEY, "invalid signature when validating"),
    ("tampered", TAMPERED, "invalid or missing digest in claim"),
    ("altered", WRONG_KEY, "invalid signature when validating"),
]


@pytest.mark.parametrize("role", ["base", "layer"])
@pytest.mark.parametrize(("case", "reason", "cosign_says"), REFUSALS)
async def test_bad_signatures_are_refused_naming_the_image(
    tmp_path: Path,
    registry: LocalRegistry,
    cosign: Path,
    signed: Signed,
    case: str,
    reason: str,
    cosign_says: str,
    role: str,
) -> None:
    store = _store(tmp_path, registry, cosign)
    base = signed.ref(case if role == "base" else "good", "base")
    layer = signed.ref(case if role == "layer" else "good", "layer")
    bad = base if role == "base" else layer
    with pytest.raises(SignatureError) as info:
        await store.prepare(base, layer, public_key=signed.a.public_key_pem)
    err = info.value
    assert (err.reason, err.image) == (reason, bad)
    assert err.role == ("image" if role == "base" else "runner layer")
    msg = str(err)
    assert msg.startswith(f"{err.role} {bad} ")
    assert key_fingerprint(signed.a.public_key_pem)[0] in msg
    assert cosign_says in msg  # cosign's own verdict, carried into the message
    # nothing was pulled or unpacked, nothing is cached
    assert store.builds == 0 and _cache_is_empty(tmp_path)
    # the same references without a signature requirement are fine: the refusal was the key's
    assert (await store.prepare(base, layer)).verified_by is None

    v = verification(_request(base, layer, signed.a.public_key_pem), err)
    assert v is not None and (v.verified, v.reason) == (False, reason)
    assert bad in v.message


def _request(
    image: str, layer: str | None, key: str | None, workdir: Path = Path("/nonexistent")
) -> VMRequest:
    return VMRequest(
        vm_id="test.signed.0000",
        name="signed",
        namespace="test",
        image=image,
        runner_layer=layer,
        allow_unpinned_images=False,
        vcpu=1,
        memory_mib=256,
        disk_gib=1,
        workdir=workdir,
        verify_public_key=key,
    )


async def test_cache_never_lets_a_verified_digest_bypass_another_key_or_repository(
    tmp_path: Path, registry: LocalRegistry, cosign: Path, signed: Signed
) -> None:
    base, layer = signed.ref("good", "base"), signed.ref("good", "layer")
    store = _store(tmp_path, registry, cosign)
    assert (await store.prepare(base, layer, public_key=signed.a.public_key_pem)).verified_by
    assert (await store.prepare(base, layer, public_key=signed.a.public_key_pem)).verified_by
    assert store.builds == 1  # verified once for key a, then served from the cache

    # a template with another key: the cached entry does not count, cosign decides again
    with pytest.raises(SignatureError) as info:
        await store.prepare(base, layer, public_key=signed.b.public_key_pem)
    assert (info.value.reason, info.value.image) == (WRONG_KEY, base)
    # the same digests from repositories where they are not signed
    same_digest_unsigned = signed.ref("unsigned", "base")
    assert parse_reference(same_digest_unsigned).digest == parse_reference(base).digest
    with pytest.raises(SignatureError) as info:
        await store.prepare(same_digest_unsigned, layer, public_key=signed.a.public_key_pem)
    assert (info.value.reason, info.value.image) == (UNSIGNED, same_digest_unsigned)

    # pulled without a requirement first: that entry does not satisfy a requirement later
    plain = signed.ref("unsigned", "layer")
    assert (await store.prepare(base, plain)).verified_by is None
    with pytest.raises(SignatureError):
        await store.prepare(base, plain, public_key=signed.a.public_key_pem)

    # and a restarted agent (a new store on the same cache directory) holds to all of it
    again = _store(tmp_path, registry, cosign)
    with pytest.raises(SignatureError):
        await again.prepare(base, layer, public_key=signed.b.public_key_pem)
    assert (await again.prepare(base, layer, public_key=signed.a.public_key_pem)).verified_by
    assert again.builds == 0


async def test_unusable_key_or_missing_cosign_fails_closed(
    tmp_path: Path, registry: LocalRegistry, cosign: Path, signed: Signed
) -> None:
    base, layer = signed.ref("good", "base"), signed.ref("good", "layer")
    store = _store(tmp_path, registry, cosign)
    junk = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"
    with pytest.raises(SignatureError) as info:
        await store.prepare(base, layer, public_key=junk)
    assert info.value.reason == "VerifyKeyInvalid" and base in str(info.value)

    no_cosign = ImageStore(
        tmp_path / "other", 1 << 30, {registry.address}, cosign=str(tmp_path / "no-cosign")
    )
    with pytest.raises(SignatureError) as info:
        await no_cosign.prepare(base, layer, public_key=signed.a.public_key_pem)
    assert info.value.reason == VERIFIER_UNAVAILABLE and base in str(info.value)
    assert no_cosign.builds == 0


def test_refusal_reasons_follow_cosign_exit_codes() -> None:
    assert classify_refusal(10, "Error: no signatures found") == (UNSIGNED, "has no signature")
    assert classify_refusal(12, "no matching signatures: invalid or missing digest in claim: x")[
        0
    ] == (TAMPERED)
    assert classify_refusal(12, "invalid signature when validating ASN.1 encoded signature")[0] == (
        WRONG_KEY
    )
    assert classify_refusal(12, "something new")[0] == "ImageSignatureRejected"
    # not a verdict about signatures: registry down, bad flags
    assert classify_refusal(1, "dial tcp 127.0.0.1:1: connection refused") is None
    assert classify_refusal(11, "no such tag") is None
    assert verification(_request("r@sha256:" + "1" * 64, None, None)) is None


async def test_signing_keys_stay_out_of_the_cache(
    tmp_path: Path, registry: LocalRegistry, cosign: Path, signed: Signed
) -> None:
    store = _store(tmp_path, registry, cosign)
    await store.prepare(
        signed.ref("good", "base"), signed.ref("good", "layer"), public_key=signed.a.public_key_pem
    )
    private = signed.a.private_key.read_bytes()
    password = signed.a.password.encode()
    for root, _dirs, files in os.walk(tmp_path / "cache"):
        for name in files:
            p = Path(root) / name
            if p.is_symlink() or not p.is_file():
                continue
            data = p.read_bytes()
            assert private not in data and password not in data, p
