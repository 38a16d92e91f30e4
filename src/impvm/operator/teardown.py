"""Removing a pool's runner registrations when the pool is deleted."""

from __future__ import annotations

import base64
import logging
from typing import Any

from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret

from impvm.api.models import ImpVMRunnerPool
from impvm.github import DeleteOutcome, GitHubClient, Scope, credentials_from_secret
from impvm.github.errors import GitHubError
from impvm.operator.context import OperatorContext
from impvm.operator.pool import runner_prefix

log = logging.getLogger("impvm.operator.teardown")


async def deregister_pool_runners(ctx: OperatorContext, namespace: str, body: Any) -> int:
    """Delete every registration of the pool (by its name prefix) that GitHub accepts to delete.
    Returns how many were busy (422) and so kept. GitHub failures are logged and end the
    attempt (returning 0): a deleted pool must not hang on an unreachable GitHub."""
    pool = ImpVMRunnerPool.model_validate(dict(body))
    meta = body["metadata"]
    platform = pool.spec.platform
    try:
        sec = await ctx.kube.get(Secret, platform.credentials_secret, namespace=namespace)
    except ApiError as e:
        log.warning("pool %s/%s deleted; credentials unreadable (%s)", namespace, meta["name"], e)
        return 0
    data = {k: base64.b64decode(v) for k, v in (sec.data or {}).items()}
    scope = Scope(org=platform.scope.org, repo=platform.scope.repo)
    s = ctx.settings
    try:
        creds = credentials_from_secret(data, platform.token_source)
        async with GitHubClient(
            creds, server_url=platform.server_url, api_url=s.github_api_url, retry=s.github_retry
        ) as gh:
            busy = 0
            prefix = runner_prefix(meta["name"], meta["uid"])
            for r in await gh.list_runners(scope, name_prefix=prefix):
                if await gh.delete_runner(scope, r.id) is DeleteOutcome.BUSY:
                    busy += 1
            return busy
    except GitHubError as e:
        log.warning("pool %s/%s deleted; registrations not removed: %s", namespace, meta["name"], e)
        return 0
