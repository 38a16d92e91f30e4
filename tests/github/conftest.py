"""Fixtures for the GitHub integration tests: a real stand-in over real HTTP, seeded."""

from __future__ import annotations

from collections.abc import AsyncIterator

import gh_support as gs
import pytest
from pydantic import SecretStr

from impvm.devstack.standin import StandIn
from impvm.github import AppCredentials, GitHubClient, RetryPolicy
from tests.support import standin_fixture


@pytest.fixture(scope="session")
def private_key() -> str:
    return gs.make_key()


@pytest.fixture(scope="session")
def other_key() -> str:
    return gs.make_key()


standin = standin_fixture(gs.APP_ID, gs.INSTALLATION_ID, gs.ORG, gs.ALL_PERMISSIONS, [gs.REPO])


@pytest.fixture
def sleep() -> gs.RecordingSleep:
    return gs.RecordingSleep()


@pytest.fixture
def clock() -> gs.Clock:
    return gs.Clock()


@pytest.fixture
def credentials(private_key: str) -> AppCredentials:
    return AppCredentials(gs.APP_ID, gs.INSTALLATION_ID, SecretStr(private_key))


@pytest.fixture
async def client(
    standin: StandIn, credentials: AppCredentials, sleep: gs.RecordingSleep, clock: gs.Clock
) -> AsyncIterator[GitHubClient]:
    c = GitHubClient(
        credentials,
        api_url=standin.url,
        sleep=sleep,
        clock=clock,
        timeout=5.0,
        retry=RetryPolicy(max_transient_retries=3),
    )
    yield c
    await c.close()
