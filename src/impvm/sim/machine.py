"""One simulated VM as the engine changes it (:class:`Machine`), and the read model every
observer of the simulated pool gets of it (:meth:`Machine.vm`: :class:`impvm.api.vm.VM`, as
the operator's caches would hold it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from impvm.api.models import (
    POOL_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    ImpVMSpec,
    ImpVMStatus,
    JobStatus,
    VMPhase,
)
from impvm.api.vm import VM
from impvm.sim.world import CLASS, POOL, TEMPLATE, TEMPLATE_HASH, TRIGGER_ANNOTATION

__all__ = ["Machine"]

_SPEC = ImpVMSpec.model_validate(
    {"classRef": {"name": CLASS[0]}, "image": TEMPLATE.image, "runnerConfigSecret": "-"}
)


@dataclass(slots=True, eq=False)
class Machine:
    """One simulated VM as the engine changes it: created (seconds, datetime), its runner
    online, the job GitHub gave it (reserved, or running once ``started``), ``done`` once that
    job finished; ``recorded``: what the operator wrote on its status (runner, timings).
    :meth:`vm` is its read model, rebuilt only when something changed."""

    name: str
    runner_id: int
    created: float
    created_at: datetime
    online: float | None = None
    job: int | None = None
    started: bool = False
    done: bool = False
    trigger_job: int | None = None
    repository: str = "sim/repo"
    recorded: dict[str, object] = field(default_factory=dict)
    _vm: VM | None = None

    @property
    def idle(self) -> bool:
        return self.online is not None and not self.started and not self.done

    @property
    def busy(self) -> bool:
        return self.started and not self.done

    def changed(self) -> None:
        self._vm = None

    def vm(self) -> VM:
        if self._vm is not None:
            return self._vm
        phase = (
            VMPhase.SUCCEEDED
            if self.done
            else (VMPhase.RUNNING if self.online is not None else VMPhase.STARTING)
        )
        status = ImpVMStatus.model_validate(
            {"runner": {"id": self.runner_id, "name": self.name}, **self.recorded}
        )
        status.phase = phase
        if self.started and self.job is not None:
            status.job = JobStatus(
                id=self.job, workflow_run_id=self.job, repository=self.repository
            )
        annotations = {TEMPLATE_HASH_ANNOTATION: TEMPLATE_HASH}
        if self.trigger_job is not None:
            annotations[TRIGGER_ANNOTATION] = str(self.trigger_job)
        self._vm = VM(
            namespace=POOL,
            name=self.name,
            uid=f"uid-{self.runner_id}",
            created_at=self.created_at,
            spec=_SPEC.model_copy(update={"runner_config_secret": f"{self.name}-jit"}),
            status=status,
            labels={POOL_LABEL: POOL},
            annotations=annotations,
        )
        return self._vm
