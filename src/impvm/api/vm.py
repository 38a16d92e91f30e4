"""The one read model of an ImpVM: what every component knows of a VM, parsed once from the
object the API server returns (the pool pass, the reaper, the agent, the simulator and the watch
caches all read this type). Pure: parsing only, no I/O.

Behaviour lives on the type, as on ARC's ``EphemeralRunner`` (``IsDone``, ``HasJob``):

- :attr:`VM.is_terminal`: its runner is done (``Succeeded`` or ``Failed``: each runner is
  single-use);
- :attr:`VM.has_job`: a job is recorded on it (``status.job``);
- :meth:`VM.made_from`: the template hash it was made from (roll-outs compare it);
- :meth:`VM.holds_capacity`: it counts against a node's capacity.

Also here: :func:`template_hash`, what a VM is made from in 16 hex digits (the
``imp.dev/template-hash`` annotation, like ARC's spec hash).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from impvm.api.models import (
    AGENT_FINALIZER,
    BOUND_SIZE_ANNOTATION,
    POOL_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    TERMINAL_PHASES,
    Condition,
    ImpVMClassSpec,
    ImpVMSpec,
    ImpVMStatus,
    VMPhase,
)
from impvm.api.times import parse_time

__all__ = ["VM", "parse_size", "template_hash"]

#: creationTimestamp of an object that has none (never on the API server: a test's object)
_EPOCH = dt.datetime.fromtimestamp(0, dt.UTC)


def template_hash(
    *,
    image: str,
    runner_layer: str | None,
    class_name: str,
    vcpu: int | None,
    memory_mib: int | None,
    disk_gib: int | None,
    expire_after: str | None,
    allow_unpinned: bool,
    network: dict[str, Any] | None = None,
    verify_key: str | None = None,
) -> str:
    """16 hex digits naming what a VM is made from. Two VMs with equal hashes are
    interchangeable; a VM whose hash differs from what the pool makes now is outdated.
    ``verify_key``: the fingerprint of the key the images must be signed by (a rotated key
    recycles idle VMs too; None leaves the hash of unsigned templates as it was)."""
    doc: dict[str, Any] = {
        "image": image,
        "runnerLayer": runner_layer,
        "class": [class_name, vcpu, memory_mib, disk_gib],
        "expireAfter": expire_after,
        "allowUnpinnedImages": allow_unpinned,
    }
    if network is not None:  # the pool's egress policy: a change recycles idle VMs too
        doc["network"] = network
    if verify_key is not None:
        doc["verifyKey"] = verify_key
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def parse_size(raw: object) -> tuple[int, int] | None:
    """A size annotation ``<vCPU>,<MiB>`` (``imp.dev/bound-size``, a VM pod's
    ``imp.dev/vm-size``); None when absent, or not two ASCII numbers within the CRD's class
    limits (an annotation is never trusted to crash a reader)."""
    vcpu, _, mib = str(raw or "").partition(",")
    if not (vcpu.isascii() and vcpu.isdigit() and mib.isascii() and mib.isdigit()):
        return None
    if len(vcpu) > 4 or len(mib) > 8:  # at most 9999 vCPU, ~95 TiB
        return None
    return int(vcpu), int(mib)


@dataclass(frozen=True, slots=True, kw_only=True)
class VM:
    """An ImpVM as read: identity, metadata facts, parsed spec and status.

    - ``status``: the parsed ``status`` (empty before anyone wrote one, and when it cannot be
      parsed: then ``unreadable`` says why); ``stored_status``: the status as stored, for what
      must judge the record itself (the reaper never trusts a job record it cannot read);
    - ``owner_uids``: uids of every owner; ``controller_uid``: the controller owner's.
    """

    namespace: str
    name: str
    uid: str = ""
    resource_version: str = ""
    created_at: dt.datetime = _EPOCH
    spec: ImpVMSpec
    status: ImpVMStatus = field(default_factory=ImpVMStatus)
    stored_status: Mapping[str, Any] = field(default_factory=dict)
    deleting: bool = False
    finalizers: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    owner_uids: frozenset[str] = frozenset()
    controller_uid: str | None = None
    unreadable: str | None = None

    @classmethod
    def from_body(cls, raw: Mapping[str, Any], *, strict: bool = False) -> VM:
        """Parse an ImpVM as the API server returns it. Raises pydantic's ``ValidationError``
        when its spec is not one, and with ``strict`` when its status is not one; else such a
        status leaves ``status`` empty and says why in ``unreadable``."""
        meta = raw.get("metadata") or {}
        stored = raw.get("status") or {}
        unreadable = None
        try:
            status = ImpVMStatus.model_validate(stored)
        except ValidationError as e:
            if strict:
                raise
            status = ImpVMStatus()
            unreadable = f"status not readable ({e.error_count()} error(s))"
        refs = meta.get("ownerReferences") or ()
        controller = next(
            (str(r["uid"]) for r in refs if r.get("controller") and r.get("uid")), None
        )
        return cls(
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            uid=str(meta.get("uid") or ""),
            resource_version=str(meta.get("resourceVersion") or ""),
            created_at=parse_time(meta.get("creationTimestamp")) or _EPOCH,
            spec=ImpVMSpec.model_validate(raw["spec"]),
            status=status,
            stored_status=stored,
            deleting=bool(meta.get("deletionTimestamp")),
            finalizers=tuple(meta.get("finalizers") or ()),
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
            owner_uids=frozenset(str(r["uid"]) for r in refs if r.get("uid")),
            controller_uid=controller,
            unreadable=unreadable,
        )

    # ---------------------------------------------------------------- identity

    @property
    def key(self) -> tuple[str, str]:
        """``(namespace, name)``."""
        return (self.namespace, self.name)

    @property
    def vm_id(self) -> str:
        """The runtime's id of this VM: ``<namespace>.<name>.<uid[:8]>`` (unique per object)."""
        return f"{self.namespace}.{self.name}.{self.uid[:8]}"

    @property
    def pool(self) -> str:
        """The pool it belongs to (label ``imp.dev/runner-pool``; ``""``: none)."""
        return str(self.labels.get(POOL_LABEL) or "")

    @property
    def node_name(self) -> str | None:
        """``spec.nodeName`` (None or ``""``: unbound)."""
        return self.spec.node_name

    @property
    def class_name(self) -> str:
        """``spec.classRef.name``."""
        return self.spec.class_ref.name

    # ---------------------------------------------------------------- state

    @property
    def phase(self) -> VMPhase | None:
        """``status.phase``."""
        return self.status.phase

    @property
    def is_terminal(self) -> bool:
        """Its runner is done: ``Succeeded`` or ``Failed`` (it never leaves them)."""
        return self.phase in TERMINAL_PHASES

    @property
    def has_job(self) -> bool:
        """A job is recorded on it (``status.job``: its id, run id or repository), as the API
        server stores it; a VM without one has run none that anyone recorded."""
        job = self.stored_status.get("job") if self.stored_status else None
        if isinstance(job, Mapping):
            return any(job.get(k) is not None for k in ("id", "workflowRunId", "repository"))
        j = self.status.job
        return j is not None and (
            j.id is not None or j.workflow_run_id is not None or j.repository is not None
        )

    @property
    def runner_id(self) -> int | None:
        """``status.runner.id``, recorded when its JIT config was minted."""
        return self.status.runner.id if self.status.runner else None

    @property
    def runner_seen(self) -> bool:
        """GitHub was seen to list its runner online or busy (as recorded on the VM)."""
        r, t = self.status.runner, self.status.timings
        return bool(r and (r.online or r.busy)) or bool(t and t.runner_online_at)

    @property
    def bound_size(self) -> tuple[int, int] | None:
        """The (vCPU, MiB) the operator bound it with (annotation ``imp.dev/bound-size``);
        None when it carries none, or one that is not two ASCII numbers within the CRD's
        class limits (an annotation is never trusted to crash a reader)."""
        return parse_size(self.annotations.get(BOUND_SIZE_ANNOTATION))

    def holds_capacity(self, node: str) -> bool:
        """Whether it counts against ``node``'s capacity: bound there and not yet released
        (the agent's finalizer is on it)."""
        return self.node_name == node and AGENT_FINALIZER in self.finalizers

    def owned_by(self, uid: str) -> bool:
        """Whether the object of ``uid`` is one of its owners."""
        return uid in self.owner_uids

    def condition(self, type_: str) -> Condition | None:
        """Its condition of ``type_``, if set."""
        return next((c for c in self.status.conditions or () if c.type == type_), None)

    def made_from(
        self, class_name: str | None = None, class_spec: ImpVMClassSpec | None = None
    ) -> str:
        """The template hash of this VM: its annotation, else computed from its spec (a VM made
        before the annotation existed), with ``class_spec``'s size when ``class_name`` is its
        class."""
        recorded = self.annotations.get(TEMPLATE_HASH_ANNOTATION)
        if recorded:
            return recorded
        size = class_spec if class_spec is not None and class_name == self.class_name else None
        return template_hash(
            image=self.spec.image,
            runner_layer=self.spec.runner_layer,
            class_name=self.class_name,
            vcpu=size.vcpu if size else None,
            memory_mib=size.memory_mib if size else None,
            disk_gib=size.disk_gib if size else None,
            expire_after=self.spec.expire_after,
            allow_unpinned=bool(self.spec.allow_unpinned_images),
        )
