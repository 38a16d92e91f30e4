"""Signed images end to end on the embedded stack: a template that requires signatures by a key
in a Secret; the operator (as its ServiceAccount) copies the public key onto each VM, the agent
(as its ServiceAccount, reading no Secret but JIT configs) verifies with cosign and boots, and a
template whose key did not sign the images gets Failed VMs with a condition and an Event naming
the image."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Secret

from impvm.api.models import POOL_LABEL
from impvm.api.resources import ImpVMClassResource, ImpVMResource, ImpVMTemplateResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE
from impvm.devstack.signing import generate_key_pair, sign_image
from impvm.devstack.stack import Stack, wait_for
from impvm.signing.cosign import SigningError, cosign_binary

pytestmark = [pytest.mark.controlplane]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    try:
        cosign = cosign_binary(build=False)
    except SigningError as e:  # scripts/setup.sh builds it: missing means a broken setup
        pytest.fail(str(e), pytrace=False)
    s = Stack(
        StackConfig(
            workdir=tmp_path / "stack",
            polling_interval_seconds=5,
            apply_example=False,
            cosign=cosign,
        )
    )
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


async def _template(stack: Stack, name: str, key_secret: str) -> None:
    assert stack.kube is not None and stack.images is not None
    body = {
        "apiVersion": "imp.dev/v1alpha1",
        "kind": "ImpVMTemplate",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "classRef": {"name": "runner-class"},
            "image": stack.images.base,
            "runnerLayer": stack.images.runner_layer,
            "verify": {"publicKeySecretRef": {"name": key_secret}},
        },
    }
    await stack.kube.create(ImpVMTemplateResource.from_dict(body))


async def _key_secret(stack: Stack, name: str, pem: str) -> None:
    assert stack.kube is not None
    data = {"cosign.pub": base64.b64encode(pem.encode()).decode()}
    await stack.kube.create(Secret(metadata=ObjectMeta(name=name, namespace=NAMESPACE), data=data))


def _of_pool(vms: list[dict[str, Any]], pool: str) -> list[dict[str, Any]]:
    return [v for v in vms if v["metadata"].get("labels", {}).get(POOL_LABEL) == pool]


def _condition(vm: dict[str, Any]) -> dict[str, Any] | None:
    for c in (vm.get("status") or {}).get("conditions") or []:
        if c["type"] == "ImageVerified":
            return dict(c)
    return None


async def test_signed_template_boots_and_a_foreign_key_is_refused(
    stack: Stack, tmp_path: Path
) -> None:
    kube, images, cosign = stack.kube, stack.images, stack.config.cosign
    assert kube is not None and images is not None and cosign is not None
    ours = await generate_key_pair(tmp_path / "ours", cosign)
    theirs = await generate_key_pair(tmp_path / "theirs", cosign)
    for ref in (images.base, images.runner_layer):
        await sign_image(ours, ref, insecure=True, cosign=cosign)
    await kube.create(
        ImpVMClassResource.from_dict(
            {
                "apiVersion": "imp.dev/v1alpha1",
                "kind": "ImpVMClass",
                "metadata": {"name": "runner-class"},
                "spec": {"vcpu": 1, "memoryMiB": 512, "diskGiB": 1},
            }
        )
    )
    await _key_secret(stack, "our-key", ours.public_key_pem)
    await _key_secret(stack, "their-key", theirs.public_key_pem)
    await _template(stack, "signed", "our-key")
    await _template(stack, "foreign", "their-key")
    # every state a foreign-pool VM passes through: a VM that fails at start is deleted within
    # a pass (and the next one made after a backoff), so a list may never catch it Failed
    seen: list[dict[str, Any]] = []

    async def record() -> None:
        labels = {POOL_LABEL: "foreign-pool"}
        async for _, obj in kube.watch(ImpVMResource, namespace=NAMESPACE, labels=labels):
            seen.append(obj.to_dict())

    recorder = asyncio.create_task(record())
    await stack.add_pool("signed-pool", ["signed"], min_idle=1, extra={"templateName": "signed"})
    await stack.add_pool("foreign-pool", ["foreign"], min_idle=1, extra={"templateName": "foreign"})

    # signed by our key: the VM boots and its runner comes online
    async def signed_idle() -> bool:
        return (await stack.pool_status("signed-pool")).get("idle") == 1

    await wait_for("the signed pool's runner online", signed_idle, 180, stack)
    (vm,) = [
        v for v in _of_pool(await stack.vms(), "signed-pool") if v["status"]["phase"] == "Running"
    ]
    assert vm["spec"]["verify"] == {"publicKey": ours.public_key_pem}
    cond = _condition(vm)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "Verified"), cond
    assert images.base in cond["message"] and images.runner_layer in cond["message"]

    # the foreign template's key did not sign them: Failed, with a condition and an Event
    async def refused() -> dict[str, Any] | None:
        for v in list(seen):
            if (v.get("status") or {}).get("exitReason") == "ImageWrongKey":
                return v
        return None

    bad = await wait_for("a foreign-pool VM refused", refused, 120, stack)
    assert bad["status"]["phase"] == "Failed"
    assert bad["spec"]["verify"] == {"publicKey": theirs.public_key_pem}
    cond = _condition(bad)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "ImageWrongKey")
    assert images.base in cond["message"]
    name = bad["metadata"]["name"]

    async def event() -> Event | None:
        async for e in kube.list(Event, namespace=NAMESPACE):
            if e.involvedObject.name == name and e.reason == "ImageWrongKey":
                return e
        return None

    ev = await wait_for("the refusal Event", event, 30, stack)
    assert ev.type == "Warning" and ev.message and images.base in ev.message
    # no VM of the foreign pool ever ran
    recorder.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await recorder
    assert seen
    for v in seen:  # a refused image is judged while the VM starts: it never runs
        assert (v.get("status") or {}).get("phase") not in ("Running", "Succeeded")
    assert "Traceback" not in stack.logs()
