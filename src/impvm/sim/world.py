"""What a scaling policy sees and returns in the simulator (shared by the engine and policies).

Times are seconds since the start of the simulation unless a field says datetime.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["Actions", "Policy", "PoolView", "SimVM"]


@dataclass(slots=True, eq=False)
class SimVM:
    """One VM of the simulated pool (the engine changes it; policies only read it).

    - ``created``/``created_at``: when the VM was created (seconds; the same as a datetime).
    - ``online``/``online_at``: when its runner came online on GitHub (None: still starting).
    - ``job``: the trace index of the job GitHub gave it (reserved, or running once
      ``started``); ``done``: that job finished and the VM is ``Succeeded``.
    - ``trigger_job``: the job the policy created it for (GARM labels runners so), if any.

    A runner a job is being assigned to still looks idle to every observer: GitHub reports it
    busy only once the job is in progress.
    """

    name: str
    runner_id: int
    created: float
    created_at: datetime
    online: float | None = None
    online_at: datetime | None = None
    job: int | None = None
    started: bool = False
    done: bool = False
    trigger_job: int | None = None

    @property
    def idle(self) -> bool:
        """Online, not running a job, not finished."""
        return self.online is not None and not self.started and not self.done

    @property
    def starting(self) -> bool:
        """Created, runner not yet online."""
        return self.online is None and not self.done

    @property
    def busy(self) -> bool:
        """Running a job."""
        return self.started and not self.done


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolView:
    """One controller pass's view of the pool and its demand.

    - ``now`` (seconds) / ``clock`` (aware datetime): the pass's clock.
    - ``vms``: every VM of the pool, oldest first (finished ones until a policy deletes them).
    - ``queued``: the pool's jobs queued on GitHub (not yet in progress), including those being
      assigned to an idle runner; ``queued_jobs``: ``(trace index, queued seconds)`` of each,
      oldest first.
    - Since the previous pass: ``arrivals`` (queued times), ``ready`` (``(time, seconds from
      creation)`` of runners that came online), ``started`` (``(job, VM name)``) and
      ``completed`` (count).
    """

    now: float
    clock: datetime
    vms: tuple[SimVM, ...]
    queued: int
    queued_jobs: tuple[tuple[int, float], ...] = ()
    arrivals: tuple[float, ...] = ()
    ready: tuple[tuple[float, float], ...] = ()
    started: tuple[tuple[int, str], ...] = ()
    completed: int = 0


@dataclass(frozen=True, slots=True)
class Actions:
    """What a pass does: create ``create`` VMs (the i-th made for job ``triggers[i]`` when
    given) and delete the VMs named in ``delete``. Deleting a busy VM is an error; deleting a
    runner a job is being assigned to sends the job back to the queue (GitHub re-queues it)."""

    create: int = 0
    delete: tuple[str, ...] = ()
    triggers: tuple[int | None, ...] = ()


class Policy(Protocol):
    """A scaling policy under test: fresh per run (it may keep state between passes)."""

    #: short key (``fixed``, ``adaptive``, ``arc``, ``garm``, ``imp``)
    name: str
    #: the key with its parameters, for the table
    label: str
    #: seconds between the passes the policy runs without any event (its resync or loop)
    tick_seconds: float
    #: ``resync``: a pass ``tick_seconds`` after the previous one when nothing woke it;
    #: ``loop``: passes on a fixed grid as well, whatever else happens
    tick_mode: str

    def plan(self, view: PoolView) -> Actions:
        """Decide one pass."""
        ...
