"""App JWT, installation tokens (cache, expiry, permission scoping), installation state, PAT."""

from __future__ import annotations

import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from gh_support import (
    APP_ID,
    INSTALLATION_ID,
    ORG,
    REPO,
    Clock,
    RecordingSleep,
    api_requests,
    control,
)
from pydantic import SecretStr

from impvm.devstack.standin import StandIn
from impvm.github import (
    AppCredentials,
    GitHubClient,
    PatCredentials,
    Scope,
    api_base_url,
    create_app_jwt,
    credentials_from_secret,
)
from impvm.github.errors import (
    BadCredentials,
    CredentialsError,
    InstallationUnavailable,
    PermissionNotGranted,
)

TOKEN_PATH = "/app/installations/{installation_id}/access_tokens"


def test_jwt_claims_and_signature(private_key: str, other_key: str) -> None:
    now = 1_700_000_000
    token = create_app_jwt(APP_ID, private_key, now=now)
    public = serialization.load_pem_private_key(private_key.encode(), None).public_key()
    claims = jwt.decode(
        token, public, algorithms=["RS256"], options={"verify_exp": False, "verify_iat": False}
    )
    assert claims["iss"] == str(APP_ID)
    assert claims["iat"] == now - 60
    assert 0 < claims["exp"] - claims["iat"] <= 600
    assert jwt.get_unverified_header(token)["alg"] == "RS256"
    other_public = serialization.load_pem_private_key(other_key.encode(), None).public_key()
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(token, other_public, algorithms=["RS256"], options={"verify_exp": False})


async def test_wrong_key_is_refused_by_standin(standin: StandIn, other_key: str) -> None:
    creds = AppCredentials(APP_ID, INSTALLATION_ID, SecretStr(other_key))
    client = GitHubClient(creds, api_url=standin.url)
    with pytest.raises(BadCredentials) as info:
        await client.runner_group_id(ORG)
    assert info.value.status == 401
    assert [r["status"] for r in api_requests(standin, TOKEN_PATH)] == [401]
    assert not standin.state.tokens


async def test_token_reused_until_expiry_then_minted_again(
    standin: StandIn, client: GitHubClient, clock: Clock
) -> None:
    await client.runner_group_id(ORG)
    await client.runner_group_id(ORG)
    await client.list_runners(Scope(org=ORG))
    assert len(api_requests(standin, TOKEN_PATH)) == 1
    (token,) = standin.state.tokens.values()
    # 3600 s token, 300 s refresh margin: at +3299 s still fresh, at +3301 s re-minted.
    clock.offset = token.expires_at - time.time() - 301
    await client.list_runners(Scope(org=ORG))
    assert len(api_requests(standin, TOKEN_PATH)) == 1
    clock.offset = token.expires_at - time.time() - 299
    await client.list_runners(Scope(org=ORG))
    assert len(api_requests(standin, TOKEN_PATH)) == 2


async def test_each_call_requests_only_the_permissions_it_needs(
    standin: StandIn, client: GitHubClient
) -> None:
    group = await client.runner_group_id(ORG)
    await client.generate_jitconfig(Scope(org=ORG), "r-org", group, ["linux"])
    await client.generate_jitconfig(Scope(repo=REPO), "r-repo", 1, ["linux"])
    await client.list_runs(REPO, "queued")
    requested = [r["permissions"] for r in api_requests(standin, TOKEN_PATH)]
    assert requested == [
        {"organization_self_hosted_runners": "read"},
        {"organization_self_hosted_runners": "write"},
        {"administration": "write"},
        {"actions": "read"},
    ]


async def test_with_permissions_restricts_the_token(standin: StandIn, client: GitHubClient) -> None:
    reader = client.with_permissions({"actions": "read"})
    await reader.list_runs(REPO, "queued")
    with pytest.raises(PermissionNotGranted) as info:
        await reader.list_runners(Scope(org=ORG))
    assert info.value.status == 403
    assert [r["permissions"] for r in api_requests(standin, TOKEN_PATH)] == [{"actions": "read"}]


async def test_permission_not_granted_on_mint(standin: StandIn, client: GitHubClient) -> None:
    standin.state.installations[INSTALLATION_ID].permissions = {"metadata": "read"}
    with pytest.raises(PermissionNotGranted) as info:
        await client.generate_jitconfig(Scope(org=ORG), "r1", 1, ["linux"])
    assert info.value.status == 422
    assert not standin.state.runners


@pytest.mark.parametrize(
    ("flag", "status", "reason"), [("suspended", 403, "suspended"), ("removed", 404, "removed")]
)
async def test_unavailable_installation(
    standin: StandIn, client: GitHubClient, flag: str, status: int, reason: str
) -> None:
    await control(standin, "POST", f"/_standin/installations/{INSTALLATION_ID}", {flag: True})
    with pytest.raises(InstallationUnavailable) as info:
        await client.runner_group_id(ORG)
    assert (info.value.status, info.value.reason) == (status, reason)


async def test_suspension_after_token_was_minted(standin: StandIn, client: GitHubClient) -> None:
    await client.runner_group_id(ORG)
    standin.state.installations[INSTALLATION_ID].suspended = True
    with pytest.raises(InstallationUnavailable) as info:
        await client.runner_group_id(ORG)
    assert info.value.reason == "suspended"


async def test_pat_credentials(standin: StandIn, sleep: RecordingSleep) -> None:
    standin.state.add_pat("ghp_standinpat0000000000000000000000000", ORG)
    client = GitHubClient(
        PatCredentials(SecretStr("ghp_standinpat0000000000000000000000000")),
        api_url=standin.url,
        sleep=sleep,
    )
    assert await client.runner_group_id(ORG) == 1
    assert not api_requests(standin, TOKEN_PATH)
    bad = GitHubClient(PatCredentials(SecretStr("ghp_wrong")), api_url=standin.url, sleep=sleep)
    with pytest.raises(BadCredentials):
        await bad.runner_group_id(ORG)


async def test_ghes_server_url_uses_api_v3(standin: StandIn, credentials: AppCredentials) -> None:
    client = GitHubClient(credentials, server_url=standin.url)
    assert client.api_url == standin.url + "/api/v3"
    assert await client.runner_group_id(ORG) == 1
    assert api_base_url(None) == "https://api.github.com"
    assert api_base_url("https://github.com") == "https://api.github.com"
    assert api_base_url("https://ghe.example.com/") == "https://ghe.example.com/api/v3"


def test_credentials_from_secret(private_key: str) -> None:
    data = {
        "github_app_id": b"4242",
        "github_app_installation_id": "77",
        "github_app_private_key": private_key.encode(),
    }
    creds = credentials_from_secret(data)
    assert isinstance(creds, AppCredentials)
    assert (creds.app_id, creds.installation_id) == (4242, 77)
    assert private_key not in repr(creds)
    with pytest.raises(CredentialsError, match="github_app_installation_id"):
        credentials_from_secret({**data, "github_app_installation_id": ""})
    with pytest.raises(CredentialsError, match="github_app_private_key"):
        credentials_from_secret({**data, "github_app_private_key": "not a key"})
    pat = credentials_from_secret({"github_token": "ghp_x"}, "pat")
    assert isinstance(pat, PatCredentials)
    assert "ghp_x" not in repr(pat)
    with pytest.raises(CredentialsError, match="github_token"):
        credentials_from_secret({}, "pat")


async def test_concurrent_calls_share_one_mint(standin: StandIn, client: GitHubClient) -> None:
    import asyncio

    await asyncio.gather(*(client.list_runs(REPO, "queued") for _ in range(5)))
    assert len(api_requests(standin, TOKEN_PATH)) == 1
    assert len(api_requests(standin, "/repos/{owner}/{repo}/actions/runs")) == 5
