"""The objects the pool controller creates, built by pure ``get_*`` functions (as crate-operator's
``create.get_statefulset``): the executor sends them; tests check them without a cluster.

- :func:`get_vm`: an ImpVM made from the pool's template (``made_from``: its template hash, the
  ``imp.dev/template-hash`` annotation), controlled by the pool;
- :func:`get_jit_secret`: a VM's JIT Secret (key ``jitconfig``), controlled by the VM.
"""

from __future__ import annotations

import base64
from typing import Any

from impvm.api.models import API_VERSION, JIT_SECRET_KEY, POOL_LABEL, TEMPLATE_HASH_ANNOTATION
from impvm.scaling.poolpass import MintJit, PoolWorld

__all__ = ["get_jit_secret", "get_vm", "get_vm_spec"]


def _controller(kind: str, name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def get_vm_spec(world: PoolWorld) -> dict[str, Any]:
    """The spec (wire form) of a new VM of the pool: ephemeral, class and image copied from the
    template; runnerLayer and expireAfter from the pool, else the template; the pool's egress
    policy (the class's applies too, see :mod:`impvm.agent.network`); the template's signing
    key as ``verify.publicKey`` (the agent verifies against the VM's own spec). Raises
    ValueError when the world has no template."""
    if world.template is None:
        raise ValueError("no template: a VM cannot be made")
    t, pool = world.template.spec, world.pool.spec
    spec: dict[str, Any] = {"classRef": {"name": t.class_ref.name}, "image": t.image}
    spec["lifecycle"] = "ephemeral"
    if layer := pool.runner_layer or t.runner_layer:
        spec["runnerLayer"] = layer
    if pool.allow_unpinned_images or t.allow_unpinned_images:
        spec["allowUnpinnedImages"] = True
    if expire := pool.expire_after or t.expire_after:
        spec["expireAfter"] = expire
    if pool.network is not None:
        spec["network"] = pool.network.wire()
    if world.verify_key is not None:
        spec["verify"] = {"publicKey": world.verify_key.pem}
    return spec


def get_vm(world: PoolWorld, name: str, made_from: str) -> dict[str, Any]:
    """The ImpVM ``name`` of ``world.pool``, in the pool's namespace, labelled for the pool,
    annotated with ``made_from`` and controlled by the pool (the garbage collector removes it
    with the pool)."""
    pool = world.pool
    meta: dict[str, Any] = {"name": name, "namespace": pool.namespace}
    meta["labels"] = {POOL_LABEL: pool.name}
    meta["annotations"] = {TEMPLATE_HASH_ANNOTATION: made_from}
    meta["ownerReferences"] = [_controller("ImpVMRunnerPool", pool.name, pool.uid)]
    return {
        "apiVersion": API_VERSION,
        "kind": "ImpVM",
        "metadata": meta,
        "spec": get_vm_spec(world),
    }


def get_jit_secret(world: PoolWorld, mint: MintJit, jit_config: str) -> dict[str, Any]:
    """The JIT Secret of VM ``mint.vm``: key ``jitconfig`` (base64), labelled for the pool,
    controlled by the VM (it goes with the VM). ``jit_config`` is secret: this dict goes to
    the API server and nowhere else."""
    pool = world.pool
    meta: dict[str, Any] = {"name": mint.secret, "namespace": pool.namespace}
    meta["labels"] = {POOL_LABEL: pool.name}
    meta["ownerReferences"] = [_controller("ImpVM", mint.vm, mint.vm_uid)]
    value = base64.b64encode(jit_config.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {JIT_SECRET_KEY: value},
    }
