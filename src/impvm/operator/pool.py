"""The pool controller's shell, one pass: observe (operator) -> decide (pure) -> execute
(operator) -> conclude (pure), each crossing made once:

1. :class:`~impvm.operator.observe.PoolObserver` reads a frozen world, with the memory the
   last pass concluded;
2. :func:`~impvm.scaling.poolpass.poll_first` (pure) says whether to poll GitHub first; if so
   the observer polls and reads the job table again;
3. :func:`~impvm.scaling.poolpass.pool_acts` (pure) decides the acts;
4. :class:`~impvm.operator.provision.PoolExecutor` carries them out;
5. :func:`~impvm.scaling.poolpass.conclude_pass` (pure) concludes: status, conditions,
   Events, the next memory and the delay until the next pass, which this shell writes and
   keeps (the memory only once the status is written: the warm pool's events must not be
   folded in again).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from impvm.api.models import PoolKey
from impvm.operator.context import OperatorContext
from impvm.operator.metrics import forget_pool, record_pool
from impvm.operator.observe import PoolObserver
from impvm.operator.provision import PoolExecutor
from impvm.scaling.names import runner_prefix, secret_name
from impvm.scaling.poolpass import (
    ActsDone,
    PassConclusion,
    PoolActs,
    conclude_pass,
    poll_first,
    pool_acts,
)

__all__ = ["PoolReconciler", "runner_prefix", "secret_name"]

log = logging.getLogger("impvm.operator.pool")


class PoolReconciler:
    """Runs passes of pools, one per :meth:`reconcile` call; it keeps nothing but a parse
    cache (the memory of each pool is the context's, as each pass concluded it)."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx
        self.observer = PoolObserver(ctx)
        #: the acts and conclusion of the last pass (for logs and tests)
        self.last: tuple[PoolActs, PassConclusion] | None = None

    async def reconcile(
        self, key: PoolKey | tuple[str, str], uid: str | None = None
    ) -> float | None:
        """One pass over pool ``key`` (``uid``: the pool object the caller runs for, when it
        knows it). Returns seconds until the next pass (None: the pool is gone, and what this
        process kept of it is dropped)."""
        key = PoolKey(*key)
        pool = await self.observer.pool(key, uid)
        if pool is None:
            forget_pool(key)
            return None
        world, github = await self.observer.observe(pool)
        slot = self.ctx.pool(key)
        if world.route is not None and world.route != slot.memory.route:
            # published before the poll: a delivery from now on reaches this pool, and one
            # before it is in the poll (poll_since: the first poll starts after this pass began)
            slot.memory = replace(slot.memory, route=world.route)
        ask = poll_first(world)
        if ask is not None and github is not None:
            world = await self.observer.poll(world, github, ask)
        acts = pool_acts(world)
        sizing = acts.sizing
        log.debug("pool %s/%s: %d acts: %s", *key, acts.count, sizing and sizing.create_reason)
        try:
            done = await PoolExecutor(self.ctx, world, github).run(acts)
        except BaseException:
            # the failures seen so far (a listing, a poll) still back the pool off
            kept = conclude_pass(world, acts, ActsDone(interrupted=True)).memory
            slot.memory = replace(kept, warm=world.memory.warm)
            raise
        end = conclude_pass(world, acts, done)
        executor = PoolExecutor(self.ctx, world, github)
        for event in end.events:
            await executor.event(event)
        try:
            if end.write:
                await executor.write_status(end.status, end.conditions)
        except BaseException:
            slot.memory = replace(end.memory, warm=world.memory.warm)
            raise
        slot.memory = end.memory
        self.last = (acts, end)
        if end.counts is not None:
            record_pool(key, end.counts, done.created)
        return end.requeue
