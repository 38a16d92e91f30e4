"""The JIT mint budget of one GitHub installation, shared by its pools: no pool can spend more than
its share, so one pool whose VMs fail at once cannot starve the others. Pure bookkeeping (time
is an argument); one :class:`MintBudget` per installation lives in the operator (a cache:
after a restart it starts empty, which errs on the side of minting).

GitHub's secondary rate limit allows about 80 content-creating requests a minute (REST "Rate
limits for the REST API", "About secondary rate limits"); a JIT config is one. Over any 60 s:

- the installation mints at most ``per_minute`` (80);
- a pool mints at most ``pool_share`` of that (half) while another pool of the installation
  asked for its allowance within the last five minutes; a pool alone may use all of it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["WINDOW_SECONDS", "MintBudget"]

#: the window the budget is counted over (seconds)
WINDOW_SECONDS = 60.0
#: a pool that asked within this long counts as sharing the installation (seconds)
ACTIVE_SECONDS = 300.0


@dataclass
class MintBudget:
    """Mints of one installation by pool (a pool is named by its runner-name prefix), in
    monotonic seconds."""

    per_minute: int = 80
    pool_share: float = 0.5
    mints: dict[str, deque[float]] = field(default_factory=dict)
    asked: dict[str, float] = field(default_factory=dict)

    def _trim(self, mono: float) -> None:
        for pool, times in list(self.mints.items()):
            while times and times[0] <= mono - WINDOW_SECONDS:
                times.popleft()
            if not times:
                del self.mints[pool]
        for pool, at in list(self.asked.items()):
            if at <= mono - ACTIVE_SECONDS:
                del self.asked[pool]

    def allowance(self, pool: str, mono: float) -> int:
        """JIT configs ``pool`` may mint now (and it counts as sharing the installation)."""
        self.asked[pool] = mono
        self._trim(mono)
        used = sum(len(t) for t in self.mints.values())
        mine = len(self.mints.get(pool, ()))
        share = self.per_minute
        if len(self.asked) > 1:
            share = max(1, math.floor(self.per_minute * self.pool_share))
        return max(0, min(self.per_minute - used, share - mine))

    def charge(self, pool: str, mono: float) -> None:
        """``pool`` asked GitHub for a JIT config at ``mono`` (whatever GitHub answered)."""
        self.mints.setdefault(pool, deque()).append(mono)

    def forget(self, pool: str) -> None:
        """A pool is gone: it shares nothing any more (its mints still count for the window)."""
        self.asked.pop(pool, None)
