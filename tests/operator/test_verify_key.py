"""A template that requires signatures: the operator copies the public key from the template's
Secret onto each new VM (spec.verify.publicKey), and creates no VM while the key is unusable."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType

from impvm.api.models import TEMPLATE_HASH_ANNOTATION as HASH
from tests.operator.conftest import PoolEnv

pytestmark = [pytest.mark.controlplane]

KEY_SECRET = "image-signing-key"


def public_key_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem.decode()


async def put_key_secret(env: PoolEnv, data: dict[str, str]) -> None:
    body = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    try:
        await env.kube.create(
            Secret(metadata=ObjectMeta(name=KEY_SECRET, namespace=env.ns), data=body)
        )
    except ApiError as e:
        assert e.status.code == 409
        await env.kube.patch(
            Secret,
            KEY_SECRET,
            {"data": None},
            namespace=env.ns,
            patch_type=PatchType.MERGE,
        )
        await env.kube.patch(
            Secret, KEY_SECRET, {"data": body}, namespace=env.ns, patch_type=PatchType.MERGE
        )


async def test_public_key_is_copied_onto_each_vm_and_no_vm_without_it(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    await env.create_class()
    await env.create_template(verify={"publicKeySecretRef": {"name": KEY_SECRET}})
    await env.create_credentials()
    await env.create_pool(minIdle=1, scaleUpStep=1)

    async def refused(fragment: str) -> None:
        assert await env.run_pass() == 30.0
        c = (await env.conditions())["TemplateMissing"]
        assert (c["status"], c["reason"]) == ("True", "VerifyKeyMissing"), c
        assert f"Secret {env.ns}/{KEY_SECRET} key cosign.pub" in c["message"], c
        assert fragment in c["message"], c
        assert (await env.conditions())["Ready"]["status"] == "False"
        # fail closed: no VM (it would boot unverified images), no JIT config minted
        assert await env.vms() == []
        assert env.standin.state.requests == []

    await refused("Secret not found")
    (ev,) = env.events_with("TemplateMissing")
    assert ev.type == "Warning" and KEY_SECRET in ev.message
    await put_key_secret(env, {"key.pub": public_key_pem()})
    await refused("the Secret has no such key")
    await put_key_secret(env, {"cosign.pub": "hello"})
    await refused("not a PEM public key")
    # well-formed PEM armour around bytes that are no key
    junk = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"
    await put_key_secret(env, {"cosign.pub": junk})
    await refused("not a PEM public key")

    first = public_key_pem()
    await put_key_secret(env, {"cosign.pub": first})
    await env.run_pass()
    assert (await env.conditions())["TemplateMissing"]["status"] == "False"
    (vm,) = await env.vms()
    assert vm["spec"]["verify"] == {"publicKey": first}

    # a rotated key reaches the VMs created from then on, and the key's fingerprint is part of
    # the template hash: the VM made with the old key (its spec is immutable) is replaced
    name = vm["metadata"]["name"]
    second = public_key_pem()
    await put_key_secret(env, {"cosign.pub": second})
    await env.run_pass()
    vms = {v["metadata"]["name"]: v for v in await env.vms()}
    old = vms.pop(name, None)
    assert old is None or old["metadata"].get("deletionTimestamp"), old
    assert [v["spec"]["verify"]["publicKey"] for v in vms.values()] == [second]
    (new,) = vms.values()
    assert new["metadata"]["annotations"][HASH] != vm["metadata"]["annotations"][HASH]
    (gone,) = [e for e in env.events_with("VMDeleted") if name in e.message]
    assert "older template" in gone.message
    await env.assert_no_secrets(caplog)
