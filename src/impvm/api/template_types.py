"""ImpVMTemplate: what a VM is made from (a digest-pinned image and runner layer), and the
sigstore signatures the agent verifies before each pull."""

from typing import Any, ClassVar

from pydantic import Field

from impvm.api.meta import (
    DURATION_PATTERN,
    NAME_PATTERN,
    ApiModel,
    LocalObjectReference,
    _digest_rule,
    _expire_after_rule,
    cel,
)

# --------------------------------------------------------------------------------------------
# Signed images (sigstore signatures, verified by the agent through containers-policy
# sigstoreSigned in skopeo; see docs/signing.md)

#: Default key of the public key in the Secret named by ``verify.publicKeySecretRef`` (the file
#: name ``cosign generate-key-pair`` writes the public key to).
VERIFY_PUBLIC_KEY_DEFAULT_KEY = "cosign.pub"
#: Longest accepted PEM public key (an RSA 8192 key is about 1.5 KiB).
VERIFY_PUBLIC_KEY_MAX_LENGTH = 16384
#: One PEM ``PUBLIC KEY`` block (SubjectPublicKeyInfo: ECDSA, RSA or Ed25519), as cosign writes it.
PUBLIC_KEY_PEM_PATTERN = (
    r"^\s*-----BEGIN PUBLIC KEY-----\r?\n[A-Za-z0-9+/=\r\n]+-----END PUBLIC KEY-----\s*$"
)


class PublicKeySecretRef(ApiModel):
    """A key of a Secret in the template's namespace holding a PEM public key (not secret; the
    Secret is read by the operator only, never by agents)."""

    name: str = Field(
        min_length=1, max_length=253, pattern=NAME_PATTERN, description="Secret name."
    )
    key: str = Field(
        default=VERIFY_PUBLIC_KEY_DEFAULT_KEY,
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key of the PEM public key in the Secret (default cosign.pub).",
    )


class TemplateVerifySpec(ApiModel):
    """Signatures a template's images must carry: the agent boots a VM only when its image and
    runner layer each have a sigstore signature by this key for their digest and repository."""

    public_key_secret_ref: PublicKeySecretRef = Field(
        description="Secret key holding the cosign/sigstore public key (PEM) that must have "
        "signed the image and the runner layer."
    )


class VMVerifySpec(ApiModel):
    """The signature requirement of one VM, copied by the operator from its template's
    verify.publicKeySecretRef when the VM is created (so agents never read that Secret)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            f"self.publicKey.matches(r'{PUBLIC_KEY_PEM_PATTERN}')",
            "verify.publicKey must be one PEM public key (-----BEGIN PUBLIC KEY----- ... "
            "-----END PUBLIC KEY-----)",
            ".publicKey",
        ),
    ]

    public_key: str = Field(
        min_length=1,
        max_length=VERIFY_PUBLIC_KEY_MAX_LENGTH,
        description="PEM public key that must have signed the image and the runner layer.",
    )


# --------------------------------------------------------------------------------------------
# ImpVMTemplate


class ImpVMTemplateSpec(ApiModel):
    """Base image and class of a runner VM (docs/images.md, runner image contract)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        _digest_rule("image"),
        _digest_rule("runnerLayer"),
    ]

    class_ref: LocalObjectReference = Field(description="The ImpVMClass giving the VM's size.")
    image: str = Field(
        min_length=1,
        max_length=1024,
        description="OCI base image (Debian-slim userland, CMD /usr/local/bin/runner), pinned by "
        "digest: name@sha256:<64 hex>.",
    )
    runner_layer: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="OCI image whose layer supplies /home/runner/actions-runner and "
        "/usr/local/bin/runner, pinned by digest. A pool's runnerLayer takes precedence.",
    )
    expire_after: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Hard deadline of a VM from its start (Go duration, 0s or >= 60s). 0s: none.",
        json_schema_extra={"x-kubernetes-validations": [_expire_after_rule("expireAfter")]},
    )
    allow_unpinned_images: bool | None = Field(
        default=None,
        description="Opt out of digest pinning for image and runnerLayer (not for production: "
        "a tag can change under a running pool; a digest cannot).",
    )
    verify: TemplateVerifySpec | None = Field(
        default=None,
        description="Require sigstore signatures on the image and the runner layer (unset: "
        "digest pinning only).",
    )


class ImpVMTemplate(ApiModel):
    """A VM template: image + class a pool's VMs are made from."""

    kind: ClassVar[str] = "ImpVMTemplate"
    plural: ClassVar[str] = "impvmtemplates"
    short_names: ClassVar[list[str]] = ["impt"]
    namespaced: ClassVar[bool] = True

    spec: ImpVMTemplateSpec
