"""Fixtures for the GitHub integration tests: a real stand-in over real HTTP, seeded."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from gh_support import (
    ALL_PERMISSIONS,
    APP_ID,
    INSTALLATION_ID,
    ORG,
    REPO,
    Clock,
    RecordingSleep,
    make_key,
)
from pydantic import SecretStr

from impvm.devstack.standin import StandIn
from impvm.github import AppCredentials, GitHubClient, RetryPolicy


@pytest.fixture(scope="session")
def private_key() -> str:
    return make_key()


@pytest.fixture(scope="session")
def other_key() -> str:
    return make_key()


@pytest.fixture
async def standin(private_key: str) -> AsyncIterator[StandIn]:
    s = StandIn()
    await s.start()
    s.state.add_app(APP_ID, private_key)
    s.state.add_installation(INSTALLATION_ID, APP_ID, ORG, ALL_PERMISSIONS)
    s.state.add_repo(REPO)
    yield s
    await s.stop()


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def credentials(private_key: str) -> AppCredentials:
    return AppCredentials(APP_ID, INSTALLATION_ID, SecretStr(private_key))


@pytest.fixture
async def client(
    standin: StandIn, credentials: AppCredentials, sleep: RecordingSleep, clock: Clock
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
