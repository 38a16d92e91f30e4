"""Helpers shared by the test packages: a GitHub stand-in seeded with one App installation, and
waiting on a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest

from impvm.devstack.standin import StandIn


@asynccontextmanager
async def seeded_standin(
    private_key: str,
    *,
    app_id: int,
    installation_id: int,
    org: str,
    permissions: Mapping[str, str],
    repos: Iterable[str] = (),
    runner_groups: Iterable[str] = (),
) -> AsyncIterator[StandIn]:
    """A started stand-in knowing the App (its key), the org's installation with
    ``permissions``, ``repos`` and the org's ``runner_groups``; stopped on exit."""
    s = StandIn()
    await s.start()
    st = s.state
    st.add_app(app_id, private_key)
    st.add_org(org)
    for repo in repos:
        st.add_repo(repo)
    for group in runner_groups:
        st.add_runner_group(org, group)
    st.add_installation(installation_id, app_id, org, permissions)
    try:
        yield s
    finally:
        await s.stop()


def standin_fixture(
    app_id: int,
    installation_id: int,
    org: str,
    permissions: Mapping[str, str],
    repos: Iterable[str] = (),
    runner_groups: Iterable[str] = (),
) -> Any:
    """A ``standin`` fixture (per test) seeded as :func:`seeded_standin` says; it needs a
    ``private_key`` fixture."""
    seed: dict[str, Any] = dict(app_id=app_id, installation_id=installation_id, org=org)
    seed |= {"permissions": permissions, "repos": list(repos), "runner_groups": list(runner_groups)}

    @pytest.fixture
    async def standin(private_key: str) -> AsyncIterator[StandIn]:
        async with seeded_standin(private_key, **seed) as s:
            yield s

    return standin


async def until(
    what: str, check: Callable[[], Awaitable[bool]], seconds: float = 60, every: float = 0.1
) -> None:
    """Return once ``check()`` is true; raise AssertionError naming ``what`` after ``seconds``
    (a bound for a loaded machine, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(every)
