"""The GitHub stand-in's authentication: App JWTs (RS256 verified), installation access
tokens and PATs, permission checks, and the installation routes (``POST
/app/installations/{installation_id}/access_tokens``, ``GET /installation/repositories``)."""

from __future__ import annotations

import json
import time
from typing import Any

import jwt
from aiohttp import web

from impvm.devstack.standin.common import (
    CALLER_KEY,
    ApiError,
    Caller,
    paged,
    state_of,
)
from impvm.devstack.standin.records import TokenRec
from impvm.devstack.standin.shapes import iso
from impvm.devstack.standin.state import StandInState

LEVELS = {"read": 1, "write": 2, "admin": 3}


def _verify_jwt(state: StandInState, raw: str) -> Caller:
    """RS256 signature with the App's public key; claims iat/exp/iss; exp - iat <= 600 s;
    iat not in the future (60 s leeway); exp not past. Source: GitHub docs, "Generating a JSON
    Web Token (JWT) for a GitHub App"."""
    refused = ApiError(
        401,
        "A JSON web token could not be decoded",
        doc="https://docs.github.com/rest",
    )
    try:
        header = jwt.get_unverified_header(raw)
        unverified = jwt.decode(raw, options={"verify_signature": False})
    except jwt.PyJWTError:
        raise refused from None
    if header.get("alg") != "RS256":
        raise refused
    try:
        app = state.apps[int(unverified["iss"])]
    except (KeyError, ValueError, TypeError):
        raise ApiError(401, "'Issuer' claim ('iss') must be an Integer") from None
    claims: dict[str, Any] | None = None
    for key in app.keys:  # an App may have several keys at once (rotation)
        try:
            claims = jwt.decode(
                raw,
                key,
                algorithms=["RS256"],
                options={"require": ["iat", "exp", "iss"]},
                leeway=0,
            )
            break
        except jwt.ExpiredSignatureError:
            raise ApiError(401, "'Expiration time' claim ('exp') is too far in the past") from None
        except jwt.ImmatureSignatureError:
            raise ApiError(
                401, "'Issued at' claim ('iat') must be an Integer in the past"
            ) from None
        except jwt.InvalidSignatureError:
            continue
        except jwt.PyJWTError:
            raise refused from None
    if claims is None:
        raise refused
    now = time.time()
    if int(claims["iat"]) > now + 60:
        raise ApiError(401, "'Issued at' claim ('iat') must be an Integer in the past")
    if int(claims["exp"]) - int(claims["iat"]) > 600:
        raise ApiError(401, "'Expiration time' claim ('exp') is too far in the future")
    return Caller("app", f"app:{app.id}", app_id=app.id)


def caller_of(state: StandInState, request: web.Request) -> Caller:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if not value:
        return Caller("anon", f"anon:{request.remote}")
    if scheme.lower() == "bearer" and value.count(".") == 2:
        return _verify_jwt(state, value)
    if scheme.lower() not in ("token", "bearer"):
        raise ApiError(401, "Bad credentials")
    if value in state.pats:
        rec = state.pats[value]
        return Caller("pat", f"pat:{rec.account}", token=rec)
    rec2 = state.tokens.get(value)
    if rec2 is None or rec2.expires_at <= time.time():
        raise ApiError(401, "Bad credentials")
    inst = state.installations.get(rec2.installation_id or -1)
    if inst is None or inst.removed:
        raise ApiError(401, "Bad credentials")
    if inst.suspended:
        raise ApiError(403, "This installation has been suspended")
    return Caller("installation", f"installation:{inst.id}", token=rec2)


def require(request: web.Request, permission: str, level: str, account: str) -> None:
    caller = request[CALLER_KEY]
    if caller.kind == "anon":
        raise ApiError(401, "Requires authentication")
    if caller.kind == "app" or caller.token is None:
        raise ApiError(
            403, "A JSON web token cannot be used to access this resource; use an installation"
        )
    if caller.token.account != account:
        raise ApiError(404, "Not Found")
    granted = caller.token.permissions.get(permission)
    if granted is None or LEVELS[granted] < LEVELS[level]:
        raise ApiError(403, "Resource not accessible by integration")


async def create_token(request: web.Request) -> web.Response:
    state = state_of(request)
    caller = request[CALLER_KEY]
    if caller.kind != "app":
        raise ApiError(401, "A JSON web token could not be decoded")
    try:
        body = await request.json() if request.can_read_body else {}
    except json.JSONDecodeError:
        raise ApiError(400, "Problems parsing JSON") from None
    requested = dict((body or {}).get("permissions") or {})
    state.requests[-1]["permissions"] = requested
    inst = state.installations.get(int(request.match_info["installation_id"]))
    if inst is None or inst.app_id != caller.app_id or inst.removed:
        raise ApiError(404, "Not Found")
    if inst.suspended:
        raise ApiError(403, "This installation has been suspended")
    for name, level in requested.items():
        granted = inst.permissions.get(name)
        if level not in LEVELS or granted is None or LEVELS[granted] < LEVELS[level]:
            raise ApiError(422, "The permissions requested are not granted to this installation.")
    permissions = requested or dict(inst.permissions)
    token = state.new_secret("ghs_")
    expires = time.time() + state.token_ttl
    state.tokens[token] = TokenRec(token, inst.id, inst.account, permissions, expires)
    body_out = {
        "token": token,
        "expires_at": iso(expires),
        "permissions": permissions,
        "repository_selection": "all",
    }
    return web.json_response(body_out, status=201)


async def installation_repos(request: web.Request) -> web.Response:
    state = state_of(request)
    caller = request[CALLER_KEY]
    if caller.kind != "installation" or caller.token is None:
        raise ApiError(403, "This endpoint requires an installation access token")
    account = caller.token.account
    repos = [state.repository(r) for r in state.repos.values() if r.owner == account]
    return paged(request, repos, "repositories", {"repository_selection": "all"})
