"""The objects the pool controller creates, built by pure ``get_*`` functions (as crate-operator's
``create.get_statefulset``): the executor sends them; tests check them without a cluster.

- :func:`get_vm`: an ImpVM made from the pool's template (``made_from``: its template hash, the
  ``imp.dev/template-hash`` annotation), controlled by the pool;
- :func:`get_jit_secret`: a VM's JIT Secret (key ``jitconfig``), controlled by the VM;
- :func:`get_vm_pod`: a VM's pod, which holds its vCPU and memory for the Kubernetes scheduler
  (:mod:`impvm.scaling.vmpods`).
"""

from __future__ import annotations

import base64
from typing import Any

from impvm.api.models import (
    API_VERSION,
    JIT_SECRET_KEY,
    POOL_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    ClassScheduling,
)
from impvm.scaling.poolpass import MintJit, PoolWorld
from impvm.scaling.settings import VMPodSettings
from impvm.scaling.vmpods import (
    VM_POD_COMPONENT,
    VM_POD_SIZE_ANNOTATION,
    VM_POD_UID_LABEL,
    VM_POD_VM_ANNOTATION,
    CreatePod,
    vm_pod_name,
)

__all__ = ["get_jit_secret", "get_vm", "get_vm_pod", "get_vm_spec"]


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


def _node_affinity(
    settings: VMPodSettings, scheduling: ClassScheduling | None, avoid: tuple[str, ...]
) -> dict[str, Any] | None:
    """The required node affinity of a VM pod: one term per node pool selector (a node
    matching any of them), each with the class's node selector and kept away from ``avoid``
    (node names; ``matchFields`` as the DaemonSet controller pins its pods)."""
    extra = sorted((scheduling.node_selector if scheduling else {}).items())
    terms: list[dict[str, Any]] = []
    for sel in settings.node_selectors or ({},):
        # the pool's and the class's requirements both hold (a key in both must match both)
        wanted = sorted(sel.items()) + [kv for kv in extra if kv not in sel.items()]
        term: dict[str, Any] = {}
        if wanted:
            term["matchExpressions"] = [
                {"key": k, "operator": "In", "values": [v]} for k, v in wanted
            ]
        if avoid:
            term["matchFields"] = [
                {"key": "metadata.name", "operator": "NotIn", "values": list(avoid)}
            ]
        if term:
            terms.append(term)
    if not terms:
        return None
    return {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}


def get_vm_pod(
    create: CreatePod,
    settings: VMPodSettings,
    scheduling: ClassScheduling | None,
    namespace: str,
    owner_uid: str = "",
) -> dict[str, Any]:
    """The VM pod of ``create.vm`` in ``namespace`` (the installation's): it requests the VM's
    vCPU (``settings.milli_cpu_per_vcpu`` each) and its memory plus ``settings.overhead_mib``,
    the memory also as its limit (no CPU limit: KubeVirt sets none either); placed by the
    scheduler (node pools' selectors, the class's ``scheduling``, away from ``create.avoid``,
    spread by VM pods per node), or pinned with ``nodeName`` when the VM is bound.
    It runs ``settings.command`` as an unprivileged user with nothing mounted (the restricted
    Pod Security Standard). Controlled by the ConfigMap ``settings.owner_config_map`` (uid
    ``owner_uid``): only such pods are taken for VM pods, and the garbage collector removes them
    with it (``helm uninstall``, ``vmPods.enabled: false``). Not owned by the ImpVM (an owner
    must be in the same namespace): the operator deletes it when its VM ends or goes."""
    vm, (vcpu, mib) = create.vm, create.size
    milli = vcpu * settings.milli_cpu_per_vcpu
    cpu = str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"  # the API server's own form
    resources = {"cpu": cpu, "memory": f"{mib + settings.overhead_mib}Mi"}
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "restartPolicy": "Always",
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "vm",
                "image": settings.image,
                "command": list(settings.command),
                "resources": {"requests": resources, "limits": {"memory": resources["memory"]}},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    tolerations = [dict(t) for t in settings.tolerations]
    if scheduling:
        tolerations += [t.wire() for t in scheduling.tolerations]
    if tolerations:
        spec["tolerations"] = tolerations
    priority = (scheduling.priority_class_name if scheduling else "") or (
        settings.priority_class_name
    )
    if priority:
        spec["priorityClassName"] = priority
    if create.node:
        spec["nodeName"] = create.node
    else:
        if affinity := _node_affinity(settings, scheduling, create.avoid):
            spec["affinity"] = {"nodeAffinity": affinity}
        # spread by how many VM pods a node has (counted by the API server), not only by the
        # room a node reports: a node overstating its allocatable draws its share, not all
        spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": VM_POD_COMPONENT}},
            }
        ]
    meta: dict[str, Any] = {
        "name": vm_pod_name(vm.uid),
        "namespace": namespace,
        "labels": {
            "app.kubernetes.io/name": "impvm",
            "app.kubernetes.io/component": VM_POD_COMPONENT,
            VM_POD_UID_LABEL: vm.uid,
        },
        "ownerReferences": [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": settings.owner_config_map,
                "uid": owner_uid,
                "controller": True,
            }
        ],
        "annotations": {
            VM_POD_VM_ANNOTATION: f"{vm.namespace}/{vm.name}",
            VM_POD_SIZE_ANNOTATION: f"{vcpu},{mib}",
            # no scale-down of a node that runs a VM (ARC asks the same for its runner pods)
            "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
        },
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
