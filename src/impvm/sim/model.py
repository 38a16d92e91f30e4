"""The world the deciders do not control, as seeded distributions (seconds).

- ``boot``: time from a VM's creation to its runner online on GitHub (binding, image
  preparation, guest boot, runner start and registration). This is the time-to-ready the warm
  pool estimates.
- ``assign``: GitHub's assignment delay: from the moment a queued job and an idle online runner
  of its labels both exist until the job is in progress on that runner (GitHub's job broker and
  the runner's own poll for work).
- ``reaction``: from an event (a webhook delivery, a VM status change) to the start of the
  controller pass it wakes; passes that fall within one reaction time are one pass.

Each distribution is lognormal, given by its median and 95th percentile (equal: a constant).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["Distribution", "Model"]

_Z95 = 1.6448536269514722  # standard normal quantile of 0.95


@dataclass(frozen=True, slots=True)
class Distribution:
    """A lognormal distribution with ``median`` and 95th percentile ``p95`` (seconds; ``p95 ==
    median`` is the constant ``median``)."""

    median: float
    p95: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and math.isfinite(self.p95)):
            raise ValueError("median and p95 must be finite")
        if not 0 <= self.median <= self.p95:
            raise ValueError(f"need 0 <= median <= p95, got median {self.median}, p95 {self.p95}")

    def sample(self, rng: random.Random) -> float:
        """One draw (seconds >= 0)."""
        if self.p95 == self.median or self.median == 0:
            return self.median
        sigma = math.log(self.p95 / self.median) / _Z95
        return rng.lognormvariate(math.log(self.median), sigma)

    def __str__(self) -> str:
        if self.p95 == self.median:
            return f"{self.median:g}s"
        return f"median {self.median:g}s p95 {self.p95:g}s"


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    """Time-to-ready, assignment delay and controller reaction (see the module docstring);
    ``seed`` seeds every draw, so one seed gives one run."""

    boot: Distribution = Distribution(15.0, 40.0)
    assign: Distribution = Distribution(2.0, 6.0)
    reaction: float = 0.25
    seed: int = 1

    def __post_init__(self) -> None:
        if not (self.reaction >= 0 and math.isfinite(self.reaction)):
            raise ValueError("reaction must be finite and >= 0")
