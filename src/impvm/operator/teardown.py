"""Removing a pool's runner registrations when the pool is deleted."""

from __future__ import annotations

import logging
from typing import Any

from impvm.github import DeleteOutcome
from impvm.github.errors import GitHubError
from impvm.operator.context import OperatorContext
from impvm.operator.credentials import scope_of
from impvm.scaling.names import owns_runner_name
from impvm.scaling.poolpass.world import PoolObj

log = logging.getLogger("impvm.operator.teardown")


async def deregister_pool_runners(ctx: OperatorContext, body: Any) -> int:
    """Delete every registration of the pool (its runner names, see
    :mod:`impvm.scaling.names`) that GitHub accepts to delete, through the operator's GitHub
    provider. Returns how many were busy (422) and so kept. Credentials or GitHub failures are
    logged and end the attempt (returning 0): a deleted pool must not hang on an unreachable
    GitHub."""
    pool = PoolObj.from_body(body)
    platform = pool.spec.platform
    try:
        gh = await ctx.github.client(pool.namespace, platform)
        busy = 0
        scope = scope_of(platform)
        for r in await gh.list_runners(scope, name_prefix=pool.prefix):
            if not owns_runner_name(pool.prefix, r.name):
                continue
            if await gh.delete_runner(scope, r.id) is DeleteOutcome.BUSY:
                busy += 1
    except GitHubError as e:
        log.warning("pool %s/%s deleted; registrations not removed: %s", *pool.key, e)
        return 0
    if not busy:
        ctx.github.forget(pool.namespace, platform.credentials_secret)
    return busy
