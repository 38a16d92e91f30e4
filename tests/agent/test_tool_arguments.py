"""A value from outside (an image reference from a VM spec, a push destination, an image's own
symlink target) never reaches a tool as an option: references are checked against the image
reference grammar, and every tool call puts such values after ``--`` or in a position the tool
takes as data. Real tools: skopeo, cosign, bubblewrap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from impvm.agent.images import ImageStore, parse_reference
from impvm.agent.process import ProcessRuntime
from impvm.agent.runtime import ImageError, Secret
from impvm.agent.signing import SignatureError, Verifier
from impvm.devstack.registry import LocalRegistry
from impvm.images.build import copy_image
from impvm.images.options import BuiltImage, ImageBuildError
from impvm.signing.cosign import SigningError, cosign_binary
from tests.agent import hostile
from tests.agent.hostile import directory, file, symlink
from tests.runtime_fixtures import vm_request, wait_for

DIGEST = "sha256:" + "a" * 64
OPTIONS = ["-v", "--help", "--key=k8s://kube-system/app-key", "--authfile=/etc/shadow", "-"]


@pytest.mark.parametrize("ref", [f"{o}@{DIGEST}" for o in OPTIONS] + ["registry:5000/x:-t"])
async def test_an_option_looking_reference_is_refused_before_any_tool_sees_it(
    tmp_path: Path, registry: LocalRegistry, ref: str
) -> None:
    store = ImageStore(tmp_path / "cache", 1 << 30, {registry.address})
    with pytest.raises(ImageError, match="invalid image reference"):
        await store.prepare(ref)
    with pytest.raises(ImageError, match="invalid image reference"):
        parse_reference(ref)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def _public_key() -> str:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem.decode()


@pytest.mark.parametrize("ref", ["--help", "--version", "-h"])
async def test_cosign_takes_an_option_looking_reference_as_a_reference(
    tmp_path: Path, ref: str
) -> None:
    """Without ``--`` cosign read ``--help`` as its option, printed its help, exited 0: the
    verifier took that for a valid signature."""
    try:
        cosign = cosign_binary(build=False)
    except SigningError as e:  # scripts/setup.sh builds it: missing means a broken setup
        pytest.fail(str(e), pytrace=False)
    verifier = Verifier(tmp_path / "trust", str(cosign))
    key = verifier.key_for(_public_key())
    with pytest.raises(SignatureError) as err:
        await verifier.verify(key, "image", ref)
    assert err.value.reason == "VerifierUnavailable", err.value


async def test_skopeo_takes_an_option_looking_destination_as_a_destination(
    tmp_path: Path, registry: LocalRegistry
) -> None:
    """``impvm images build --out/--push`` hands its destination to skopeo copy: one that
    looks like an option is refused by skopeo as a destination (it printed its help and
    exited 0, and the build then failed reading a digest file that was never written)."""
    ref = await hostile.push_image(
        tmp_path / "img", registry.address, "args/img", "t", [[file("a", "x")]]
    )
    index = json.loads((tmp_path / "img" / "oci" / "index.json").read_text())
    image = BuiltImage(
        name="img",
        layout=tmp_path / "img" / "oci",
        tag="t",
        digest=index["manifests"][0]["digest"],
        size_bytes=0,
        unpacked_bytes=0,
        cached=True,
    )
    assert ref.endswith(image.digest)
    for dest in ("--help", "-v"):
        with pytest.raises(ImageBuildError, match="copying img to"):
            await copy_image(image, dest)


async def test_an_image_symlink_target_that_looks_like_an_option_is_data_to_bubblewrap(
    tmp_path: Path, registry: LocalRegistry
) -> None:
    """The process runtime reproduces an image's top-level symlinks with ``--symlink TARGET
    DEST``: targets such as ``--bind`` or ``--dev-bind`` stay symlinks in the sandbox."""
    base = [e for e in hostile.busybox_base() if e.name not in ("root",)]
    base += [symlink("root", "--dev-bind"), symlink("srv", "-")]
    layer = [directory(d) for d in ("usr", "usr/local", "usr/local/bin")]
    layer.append(file("usr/local/bin/runner", "#!/bin/sh\nls -l /root /srv\nexit 0\n", 0o755))
    image = await hostile.push_image(tmp_path / "b", registry.address, "args/b", "t", [base])
    runner = await hostile.push_image(tmp_path / "l", registry.address, "args/l", "t", [layer])
    rt = ProcessRuntime(ImageStore(tmp_path / "cache", 1 << 30, {registry.address}))
    req = vm_request(tmp_path, "links", image, runner, memory_mib=64)
    await rt.start(req, Secret("jit-links"))
    state = await wait_for(rt, req, None, 60)
    await rt.cleanup(req)
    assert state.exit_code == 0, state.log_tail
    assert "/root -> --dev-bind" in state.log_tail and "/srv -> -" in state.log_tail
