"""The GitHub stand-in's HTTP server (aiohttp).

GitHub REST endpoints (served at ``/`` and at ``/api/v3`` like GitHub Enterprise Server):

* ``POST /app/installations/{installation_id}/access_tokens`` (App JWT, RS256 verified)
* ``GET /orgs/{org}/actions/runner-groups``
* ``POST /orgs/{org}/actions/runners/generate-jitconfig``,
  ``POST /repos/{owner}/{repo}/actions/runners/generate-jitconfig``
* ``GET /orgs/{org}/actions/runners``, ``GET|DELETE /orgs/{org}/actions/runners/{runner_id}``
  and the ``/repos/{owner}/{repo}/actions/runners`` equivalents
* ``GET /repos/{owner}/{repo}/actions/runs``, ``.../runs/{run_id}``, ``.../runs/{run_id}/jobs``,
  ``.../jobs/{job_id}``
* ``GET /installation/repositories``, ``GET /rate_limit``

Control API (tests and the embedded stack), JSON bodies:

* ``POST /_standin/seed`` (see :meth:`StandInState.seed`), ``POST /_standin/reset``
* ``POST /_standin/jobs`` ``{"repo", "labels", "name"?, "command"?, "sleep_seconds"?}``
* ``GET /_standin/jobs``, ``GET /_standin/runners``
* ``POST /_standin/failures`` (fields of :class:`Failure`), ``DELETE /_standin/failures``
* ``POST /_standin/installations/{id}`` ``{"suspended"?, "removed"?, "permissions"?}``
* ``POST /_standin/rate-limit`` ``{"identity"?, "remaining", "reset_in", "limit"?}``
* ``GET /_standin/requests`` (method, templated path, status, identity, permissions for token
  requests, runner name for JIT config requests), ``DELETE /_standin/requests``
* ``POST /_standin/webhooks`` ``{"url", "secret"}``, ``GET /_standin/deliveries``

Stand-in private runner protocol (not GitHub's broker protocol), authenticated with the session
token from the JIT config: ``POST /_standin/runner/session``, ``POST /_standin/runner/acquire``
``{"wait": s}``, ``POST /_standin/runner/jobs/{job_id}/complete`` ``{"conclusion"}``,
``DELETE /_standin/runner/session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import aiohttp
import jwt
from aiohttp import web

from impvm.devstack.standin.state import (
    DOCS,
    LEVELS,
    Delivery,
    Failure,
    Installation,
    JobRec,
    RateBucket,
    RunnerRec,
    StandInState,
    TokenRec,
    WebhookTarget,
    iso,
)
from impvm.github.webhooks import compute_signature

API_PREFIXES = ("", "/api/v3")
#: GitHub's limit on a runner name (characters); a longer JIT request name is answered 422.
MAX_RUNNER_NAME = 64
STATE_KEY = web.AppKey("state", StandInState)
TASKS_KEY: web.AppKey[set[asyncio.Task[None]]] = web.AppKey("tasks")


class ApiError(Exception):
    """An error answered in GitHub's shape ``{"message", "documentation_url", "status"}``."""

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, doc: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.doc = doc or DOCS


def error_response(err: ApiError) -> web.Response:
    body = {"message": err.message, "documentation_url": err.doc, "status": str(err.status)}
    return web.json_response(body, status=err.status, headers=err.headers)


@dataclass
class Caller:
    """Who made a request: ``kind`` is ``app`` (JWT), ``installation``, ``pat`` or ``anon``."""

    kind: str
    identity: str
    app_id: int | None = None
    token: TokenRec | None = None


CALLER_KEY = web.RequestKey("caller", Caller)


def _state(request: web.Request) -> StandInState:
    return request.app[STATE_KEY]


def _template(request: web.Request) -> str:
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else request.path
    for prefix in API_PREFIXES[1:]:
        if path.startswith(prefix + "/"):
            return path[len(prefix) :]
    return path


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


def _caller(state: StandInState, request: web.Request) -> Caller:
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


def _require(request: web.Request, permission: str, level: str, account: str) -> None:
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


def _page(request: web.Request) -> tuple[int, int]:
    try:
        per_page = min(max(int(request.query.get("per_page", "30")), 1), 100)
        page = max(int(request.query.get("page", "1")), 1)
    except ValueError:
        raise ApiError(422, "Invalid pagination parameters") from None
    return per_page, page


def _paged(
    request: web.Request, items: list[dict[str, Any]], key: str, extra: dict[str, Any] | None = None
) -> web.Response:
    per_page, page = _page(request)
    chunk = items[(page - 1) * per_page : page * per_page]
    headers = {}
    last = max((len(items) + per_page - 1) // per_page, 1)
    if page < last:
        url = request.url.update_query(page=str(page + 1), per_page=str(per_page))
        headers["Link"] = f'<{url}>; rel="next", <{request.url.update_query(page=str(last))}>; '
        headers["Link"] += 'rel="last"'
    body = {"total_count": len(items), key: chunk, **(extra or {})}
    return web.json_response(body, headers=headers)


# ---------------------------------------------------------------------- middleware


def _matching_failure(state: StandInState, method: str, path: str) -> Failure | None:
    for failure in state.failures:
        if failure.count <= 0:
            continue
        if failure.method and failure.method.upper() != method:
            continue
        if failure.path and failure.path != path:
            continue
        if failure.probability < 1.0 and random.random() >= failure.probability:
            continue
        failure.count -= 1
        return failure
    return None


def _bucket(state: StandInState, identity: str) -> RateBucket:
    bucket = state.buckets.setdefault(identity, RateBucket(reset=time.time() + 3600))
    if time.time() >= bucket.reset:
        bucket.remaining = bucket.limit
        bucket.reset = time.time() + 3600
    return bucket


def _rate_headers(bucket: RateBucket) -> dict[str, str]:
    return {
        "x-ratelimit-limit": str(bucket.limit),
        "x-ratelimit-remaining": str(bucket.remaining),
        "x-ratelimit-reset": str(int(bucket.reset)),
        "x-ratelimit-used": str(bucket.limit - bucket.remaining),
        "x-ratelimit-resource": "core",
    }


async def _injected(failure: Failure, state: StandInState, caller: Caller) -> web.Response | None:
    if failure.kind == "timeout":
        await asyncio.sleep(failure.delay)
        return None
    if failure.kind == "status":
        return error_response(ApiError(failure.status, failure.message))
    if failure.kind == "suspend":
        return error_response(ApiError(403, "This installation has been suspended"))
    bucket = _bucket(state, caller.identity)
    headers = _rate_headers(bucket)
    if failure.kind == "primary_rate_limit":
        headers["x-ratelimit-remaining"] = "0"
        headers["x-ratelimit-used"] = str(bucket.limit)
        headers["x-ratelimit-reset"] = str(int(time.time() + failure.reset_in))
        return error_response(
            ApiError(
                403,
                f"API rate limit exceeded for {caller.identity}.",
                headers,
                "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api",
            )
        )
    if failure.kind == "secondary_rate_limit":
        if failure.retry_after is not None:
            headers["retry-after"] = str(failure.retry_after)
        return error_response(
            ApiError(
                403,
                "You have exceeded a secondary rate limit. Please wait a few minutes before you "
                "try again.",
                headers,
                "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api"
                "#about-secondary-rate-limits",
            )
        )
    raise ValueError(f"unknown failure kind {failure.kind!r}")


@web.middleware
async def github_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Auth, injected failures, rate-limit accounting, ETags and the request log for the
    GitHub-shaped routes; control routes pass straight through."""
    state = _state(request)
    if request.path.startswith("/_standin"):
        return await handler(request)
    path = _template(request)
    entry: dict[str, Any] = {
        "method": request.method,
        "path": path,
        "url": request.path,
        "time": time.time(),
        "conditional": "If-None-Match" in request.headers,
    }
    state.requests.append(entry)
    bucket: RateBucket | None = None
    try:
        caller = _caller(state, request)
        request[CALLER_KEY] = caller
        entry["identity"] = caller.identity
        failure = _matching_failure(state, request.method, path)
        if failure is not None:
            entry["injected"] = failure.kind
            injected = await _injected(failure, state, caller)
            if injected is not None:
                entry["status"] = injected.status
                return injected
        counted = path != "/rate_limit"
        if counted:
            bucket = _bucket(state, caller.identity)
            if bucket.remaining <= 0:
                raise ApiError(
                    403,
                    f"API rate limit exceeded for {caller.identity}.",
                    _rate_headers(bucket),
                    "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api",
                )
        response = await handler(request)
    except ApiError as err:
        response = error_response(err)
    assert isinstance(response, web.Response)
    if request.method == "GET" and response.status == 200 and isinstance(response.body, bytes):
        etag = 'W/"' + hashlib.sha256(response.body).hexdigest() + '"'
        response.headers["ETag"] = etag
        if etag in [t.strip() for t in request.headers.get("If-None-Match", "").split(",")]:
            # A 304 does not count against the primary rate limit (GitHub REST best practices).
            not_modified = web.Response(status=304, headers={"ETag": etag})
            if bucket is not None:
                not_modified.headers.update(_rate_headers(bucket))
            entry["status"] = 304
            return not_modified
    if bucket is not None and response.status < 500 and not response.headers.get("retry-after"):
        if not (response.status == 403 and bucket.remaining <= 0):
            bucket.remaining = max(bucket.remaining - 1, 0)
        response.headers.update(_rate_headers(bucket))
    response.headers.setdefault("X-GitHub-Request-Id", uuid.uuid4().hex[:20].upper())
    entry["status"] = response.status
    return response


# ---------------------------------------------------------------------- GitHub routes


async def create_token(request: web.Request) -> web.Response:
    state = _state(request)
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


def _org(request: web.Request) -> str:
    org = request.match_info["org"]
    if org not in _state(request).orgs:
        raise ApiError(404, "Not Found")
    return org


def _repo(request: web.Request) -> str:
    full = f"{request.match_info['owner']}/{request.match_info['repo']}"
    if full not in _state(request).repos:
        raise ApiError(404, "Not Found")
    return full


async def list_runner_groups(request: web.Request) -> web.Response:
    state = _state(request)
    org = _org(request)
    _require(request, "organization_self_hosted_runners", "read", org)
    groups = sorted((g for g in state.runner_groups.values() if g.org == org), key=lambda g: g.id)
    return _paged(request, [state.runner_group(g) for g in groups], "runner_groups")


async def _jit(request: web.Request, org: str | None, repo: str | None) -> web.Response:
    state = _state(request)
    try:
        body = await request.json()
    except json.JSONDecodeError:
        raise ApiError(400, "Problems parsing JSON") from None
    name = body.get("name")
    labels = body.get("labels")
    group_id = body.get("runner_group_id")
    state.requests[-1]["runner_name"] = name  # each VM's mints are counted by its runner name
    if not isinstance(name, str) or not name:
        raise ApiError(422, 'Invalid request.\n\n"name" wasn\'t supplied.')
    if len(name) > MAX_RUNNER_NAME:
        raise ApiError(
            422, f"Invalid request.\n\nname is too long (maximum is {MAX_RUNNER_NAME} characters)."
        )
    if not isinstance(labels, list) or not 1 <= len(labels) <= 100:
        raise ApiError(422, 'Invalid request.\n\n"labels" must have 1 to 100 items.')
    if not isinstance(group_id, int):
        raise ApiError(422, 'Invalid request.\n\n"runner_group_id" wasn\'t supplied.')
    if org is not None and (
        group_id not in state.runner_groups or state.runner_groups[group_id].org != org
    ):
        raise ApiError(404, "Not Found")
    if repo is not None and group_id != 1:
        raise ApiError(422, "Repository runners can only be added to the Default runner group.")
    for other in state.runners.values():
        if other.name == name and other.org == org and other.repo == repo:
            raise ApiError(409, "Already exists - A runner with the name already exists.")
    runner = RunnerRec(
        id=state.next_id(),
        name=name,
        labels=[str(label) for label in labels],
        group_id=group_id,
        org=org,
        repo=repo,
        session_token=state.new_secret("sess_"),
        work_folder=str(body.get("work_folder", "_work")),
    )
    state.runners[runner.id] = runner
    out = {"runner": state.runner(runner), "encoded_jit_config": state.jit_config(runner)}
    return web.json_response(out, status=201)


async def org_jit(request: web.Request) -> web.Response:
    org = _org(request)
    _require(request, "organization_self_hosted_runners", "write", org)
    return await _jit(request, org, None)


async def repo_jit(request: web.Request) -> web.Response:
    repo = _repo(request)
    _require(request, "administration", "write", repo.split("/")[0])
    return await _jit(request, None, repo)


def _scope(request: web.Request, level: str) -> tuple[str | None, str | None]:
    if "org" in request.match_info:
        org = _org(request)
        _require(request, "organization_self_hosted_runners", level, org)
        return org, None
    repo = _repo(request)
    _require(request, "administration", level, repo.split("/")[0])
    return None, repo


def _find_runner(request: web.Request, org: str | None, repo: str | None) -> RunnerRec:
    state = _state(request)
    try:
        runner = state.runners[int(request.match_info["runner_id"])]
    except (KeyError, ValueError):
        raise ApiError(404, "Not Found") from None
    if runner.org != org or runner.repo != repo:
        raise ApiError(404, "Not Found")
    return runner


async def list_runners(request: web.Request) -> web.Response:
    state = _state(request)
    org, repo = _scope(request, "read")
    name = request.query.get("name")
    runners = [
        state.runner(r)
        for r in sorted(state.runners.values(), key=lambda r: r.id)
        if r.org == org and r.repo == repo and (name is None or r.name == name)
    ]
    return _paged(request, runners, "runners")


async def get_runner(request: web.Request) -> web.Response:
    org, repo = _scope(request, "read")
    return web.json_response(_state(request).runner(_find_runner(request, org, repo)))


async def delete_runner(request: web.Request) -> web.Response:
    state = _state(request)
    org, repo = _scope(request, "write")
    runner = _find_runner(request, org, repo)
    if runner.busy:
        raise ApiError(422, f'Bad request - Runner "{runner.name}" is still running a job".')
    del state.runners[runner.id]
    return web.Response(status=204)


def _repo_read(request: web.Request) -> str:
    repo = _repo(request)
    _require(request, "actions", "read", repo.split("/")[0])
    return repo


async def list_runs(request: web.Request) -> web.Response:
    state = _state(request)
    repo = _repo_read(request)
    status = request.query.get("status")
    runs = [
        state.workflow_run(r)
        for r in sorted(state.runs.values(), key=lambda r: -r.id)
        if r.repo == repo and (status is None or status in (r.status, r.conclusion))
    ]
    return _paged(request, runs, "workflow_runs")


async def get_run(request: web.Request) -> web.Response:
    state = _state(request)
    repo = _repo_read(request)
    run = state.runs.get(int(request.match_info["run_id"]))
    if run is None or run.repo != repo:
        raise ApiError(404, "Not Found")
    return web.json_response(state.workflow_run(run))


async def list_run_jobs(request: web.Request) -> web.Response:
    state = _state(request)
    repo = _repo_read(request)
    run = state.runs.get(int(request.match_info["run_id"]))
    if run is None or run.repo != repo:
        raise ApiError(404, "Not Found")
    if request.query.get("filter", "latest") not in ("latest", "all"):
        raise ApiError(422, "Invalid filter")
    jobs = [
        state.job(j) for j in sorted(state.jobs.values(), key=lambda j: j.id) if j.run_id == run.id
    ]
    return _paged(request, jobs, "jobs")


async def get_job(request: web.Request) -> web.Response:
    state = _state(request)
    repo = _repo_read(request)
    job = state.jobs.get(int(request.match_info["job_id"]))
    if job is None or job.repo != repo:
        raise ApiError(404, "Not Found")
    return web.json_response(state.job(job))


async def installation_repos(request: web.Request) -> web.Response:
    state = _state(request)
    caller = request[CALLER_KEY]
    if caller.kind != "installation" or caller.token is None:
        raise ApiError(403, "This endpoint requires an installation access token")
    account = caller.token.account
    repos = [state.repository(r) for r in state.repos.values() if r.owner == account]
    return _paged(request, repos, "repositories", {"repository_selection": "all"})


async def rate_limit(request: web.Request) -> web.Response:
    state = _state(request)
    caller = request[CALLER_KEY]
    bucket = _bucket(state, caller.identity)
    core = {
        "limit": bucket.limit,
        "remaining": bucket.remaining,
        "reset": int(bucket.reset),
        "used": bucket.limit - bucket.remaining,
        "resource": "core",
    }
    search = {"limit": 30, "remaining": 30, "reset": int(time.time() + 60), "used": 0}
    body = {"resources": {"core": core, "search": {**search, "resource": "search"}}, "rate": core}
    return web.json_response(body, headers=_rate_headers(bucket))


# ---------------------------------------------------------------------- webhooks


def _installation_for(state: StandInState, repo: str) -> int | None:
    owner = repo.split("/")[0]
    for inst in state.installations.values():
        if inst.account == owner and not inst.removed:
            return inst.id
    return None


def emit_workflow_job(app: web.Application, action: str, job: JobRec) -> None:
    """Deliver a signed ``workflow_job`` webhook to every registered target (asynchronously)."""
    state = app[STATE_KEY]
    if not state.webhooks:
        return
    installation = _installation_for(state, job.repo)
    payload = state.workflow_job_payload(action, job, installation)
    body = json.dumps(payload).encode()
    inst = state.installations.get(installation) if installation is not None else None
    for target in list(state.webhooks):
        if target.app_id is not None and (inst is None or inst.app_id != target.app_id):
            continue  # not this App's installation: its webhook never hears of the job
        if target.drop_rate and random.random() < target.drop_rate:
            state.deliveries.append(
                Delivery(str(uuid.uuid4()), "workflow_job", action, None, error="dropped")
            )
            continue
        task = asyncio.get_running_loop().create_task(_deliver(state, target, action, body))
        app[TASKS_KEY].add(task)
        task.add_done_callback(app[TASKS_KEY].discard)


async def _deliver(state: StandInState, target: WebhookTarget, action: str, body: bytes) -> None:
    delivery = Delivery(str(uuid.uuid4()), "workflow_job", action, None)
    state.deliveries.append(delivery)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/standin",
        "X-GitHub-Event": "workflow_job",
        "X-GitHub-Delivery": delivery.id,
        "X-GitHub-Hook-ID": "1",
        "X-Hub-Signature-256": compute_signature(target.secret, body),
    }
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(target.url, data=body, headers=headers) as resp,
        ):
            delivery.status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        delivery.error = type(exc).__name__


# ---------------------------------------------------------------------- runner protocol


def _session_runner(request: web.Request) -> RunnerRec:
    state = _state(request)
    _, _, token = request.headers.get("Authorization", "").partition(" ")
    for runner in state.runners.values():
        if token and runner.session_token == token:
            runner.last_seen = time.time()
            return runner
    raise web.HTTPUnauthorized(text="unknown runner session")


async def runner_heartbeat(request: web.Request) -> web.Response:
    runner = _session_runner(request)
    if runner.status != "online":
        raise web.HTTPConflict(text="runner is offline")
    return web.Response(status=204)


def expire_runners(app: web.Application, now: float) -> None:
    """Runners silent for ``runner_timeout`` go offline; a job one was running fails (a runner
    that died mid-job: GitHub fails the job and shows the runner offline)."""
    state = app[STATE_KEY]
    for runner in list(state.runners.values()):
        if runner.status != "online" or not runner.last_seen:
            continue  # offline, or put online by a test without a session: not tracked
        if now - runner.last_seen < state.runner_timeout:
            continue
        runner.status = "offline"
        job = state.jobs.get(runner.job_id) if runner.job_id is not None else None
        if runner.busy and job is not None and job.status == "in_progress":
            job.status = "completed"
            job.conclusion = "failure"
            job.completed_at = now
            state.sync_run(job.run_id)
            emit_workflow_job(app, "completed", job)
        runner.busy = False


async def _expiry_loop(app: web.Application) -> None:
    while True:
        await asyncio.sleep(1.0)
        expire_runners(app, time.time())


async def runner_session(request: web.Request) -> web.Response:
    runner = _session_runner(request)
    runner.status = "online"
    return web.json_response({"runner_id": runner.id, "runner_name": runner.name})


async def runner_session_end(request: web.Request) -> web.Response:
    state = _state(request)
    runner = _session_runner(request)
    runner.status = "offline"
    if runner.ephemeral and runner.job_id is not None and not runner.busy:
        state.runners.pop(runner.id, None)
    return web.Response(status=204)


async def runner_acquire(request: web.Request) -> web.Response:
    state = _state(request)
    runner = _session_runner(request)
    body = await request.json() if request.can_read_body else {}
    deadline = time.monotonic() + float(body.get("wait", 0))
    if runner.job_id is not None:
        return web.json_response({"error": "ephemeral runner already took a job"}, status=409)
    while True:
        if state.runners.get(runner.id) is not runner:
            # deregistered during the long poll: GitHub hands it no job (its session is gone)
            raise web.HTTPNotFound(text="runner registration was deleted")
        runner.last_seen = time.time()  # a long poll is contact
        for job in sorted(state.jobs.values(), key=lambda j: j.id):
            if job.status == "queued" and state.runner_can_take(runner, job):
                group = state.runner_groups.get(runner.group_id)
                job.status = "in_progress"
                job.started_at = time.time()
                job.runner_id = runner.id
                job.runner_name = runner.name
                job.runner_group_id = runner.group_id
                job.runner_group_name = group.name if group else "Default"
                runner.busy = True
                runner.job_id = job.id
                state.sync_run(job.run_id)
                emit_workflow_job(request.app, "in_progress", job)
                spec = {
                    "id": job.id,
                    "labels": job.labels,
                    "command": job.command,
                    "sleep_seconds": job.sleep_seconds,
                    "repository": job.repo,
                }
                return web.json_response({"job": spec})
        if time.monotonic() >= deadline:
            return web.Response(status=204)
        await asyncio.sleep(0.1)


async def runner_complete(request: web.Request) -> web.Response:
    state = _state(request)
    runner = _session_runner(request)
    job = state.jobs.get(int(request.match_info["job_id"]))
    if job is None or job.runner_id != runner.id:
        raise web.HTTPNotFound(text="job not assigned to this runner")
    body = await request.json() if request.can_read_body else {}
    job.status = "completed"
    job.conclusion = str(body.get("conclusion", "success"))
    job.completed_at = time.time()
    runner.busy = False
    state.sync_run(job.run_id)
    emit_workflow_job(request.app, "completed", job)
    return web.json_response({"ok": True})


# ---------------------------------------------------------------------- control API


async def control_seed(request: web.Request) -> web.Response:
    _state(request).seed(await request.json())
    return web.json_response({"ok": True})


async def control_reset(request: web.Request) -> web.Response:
    state = _state(request)
    fresh = StandInState(base_url=state.base_url)
    for f in fields(StandInState):
        setattr(state, f.name, getattr(fresh, f.name))
    return web.json_response({"ok": True})


async def control_queue_job(request: web.Request) -> web.Response:
    body = await request.json()
    job = _state(request).queue_job(
        body["repo"],
        body.get("labels", ["self-hosted"]),
        name=body.get("name", "build"),
        workflow_name=body.get("workflow_name", "CI"),
        command=body.get("command"),
        sleep_seconds=float(body.get("sleep_seconds", 0)),
    )
    emit_workflow_job(request.app, "queued", job)
    return web.json_response({"job_id": job.id, "run_id": job.run_id}, status=201)


async def control_jobs(request: web.Request) -> web.Response:
    state = _state(request)
    return web.json_response([state.job(j) for j in state.jobs.values()])


async def control_runners(request: web.Request) -> web.Response:
    state = _state(request)
    out = [{**state.runner(r), "org": r.org, "repo": r.repo} for r in state.runners.values()]
    return web.json_response(out)


async def control_failure(request: web.Request) -> web.Response:
    body = await request.json()
    known = {f.name for f in fields(Failure)}
    _state(request).failures.append(Failure(**{k: v for k, v in body.items() if k in known}))
    return web.json_response({"ok": True}, status=201)


async def control_failures_clear(request: web.Request) -> web.Response:
    _state(request).failures.clear()
    return web.Response(status=204)


async def control_installation(request: web.Request) -> web.Response:
    state = _state(request)
    inst: Installation | None = state.installations.get(int(request.match_info["id"]))
    if inst is None:
        raise web.HTTPNotFound()
    body = await request.json()
    inst.suspended = bool(body.get("suspended", inst.suspended))
    inst.removed = bool(body.get("removed", inst.removed))
    if "permissions" in body:
        inst.permissions = dict(body["permissions"])
    return web.json_response({"ok": True})


async def control_rate_limit(request: web.Request) -> web.Response:
    state = _state(request)
    body = await request.json()
    identities = [body["identity"]] if body.get("identity") else None
    if identities is None:
        identities = [f"installation:{i}" for i in state.installations]
        identities += [f"pat:{p.account}" for p in state.pats.values()]
    for identity in identities:
        bucket = _bucket(state, identity)
        bucket.limit = int(body.get("limit", bucket.limit))
        bucket.remaining = int(body["remaining"])
        bucket.reset = time.time() + float(body.get("reset_in", 3600))
    return web.json_response({"ok": True})


async def control_requests(request: web.Request) -> web.Response:
    return web.json_response(_state(request).requests)


async def control_requests_clear(request: web.Request) -> web.Response:
    _state(request).requests.clear()
    return web.Response(status=204)


async def control_webhook(request: web.Request) -> web.Response:
    body = await request.json()
    _state(request).webhooks.append(
        WebhookTarget(body["url"], body["secret"], float(body.get("drop_rate", 0.0)))
    )
    return web.json_response({"ok": True}, status=201)


async def control_deliveries(request: web.Request) -> web.Response:
    return web.json_response([asdict(d) for d in _state(request).deliveries])


# ---------------------------------------------------------------------- app


def build_app(state: StandInState) -> web.Application:
    """The aiohttp application serving ``state``."""
    app = web.Application(middlewares=[github_middleware])
    app[STATE_KEY] = state
    app[TASKS_KEY] = set()
    r = app.router
    for p in API_PREFIXES:
        r.add_post(p + "/app/installations/{installation_id}/access_tokens", create_token)
        r.add_get(p + "/orgs/{org}/actions/runner-groups", list_runner_groups)
        r.add_post(p + "/orgs/{org}/actions/runners/generate-jitconfig", org_jit)
        r.add_post(p + "/repos/{owner}/{repo}/actions/runners/generate-jitconfig", repo_jit)
        for base in ("/orgs/{org}", "/repos/{owner}/{repo}"):
            r.add_get(p + base + "/actions/runners", list_runners)
            r.add_get(p + base + "/actions/runners/{runner_id}", get_runner)
            r.add_delete(p + base + "/actions/runners/{runner_id}", delete_runner)
        r.add_get(p + "/repos/{owner}/{repo}/actions/runs", list_runs)
        r.add_get(p + "/repos/{owner}/{repo}/actions/runs/{run_id}", get_run)
        r.add_get(p + "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs", list_run_jobs)
        r.add_get(p + "/repos/{owner}/{repo}/actions/jobs/{job_id}", get_job)
        r.add_get(p + "/installation/repositories", installation_repos)
        r.add_get(p + "/rate_limit", rate_limit)
    r.add_post("/_standin/seed", control_seed)
    r.add_post("/_standin/reset", control_reset)
    r.add_post("/_standin/jobs", control_queue_job)
    r.add_get("/_standin/jobs", control_jobs)
    r.add_get("/_standin/runners", control_runners)
    r.add_post("/_standin/failures", control_failure)
    r.add_delete("/_standin/failures", control_failures_clear)
    r.add_post("/_standin/installations/{id}", control_installation)
    r.add_post("/_standin/rate-limit", control_rate_limit)
    r.add_get("/_standin/requests", control_requests)
    r.add_delete("/_standin/requests", control_requests_clear)
    r.add_post("/_standin/webhooks", control_webhook)
    r.add_get("/_standin/deliveries", control_deliveries)
    r.add_post("/_standin/runner/session", runner_session)
    r.add_delete("/_standin/runner/session", runner_session_end)
    r.add_post("/_standin/runner/acquire", runner_acquire)
    r.add_post("/_standin/runner/jobs/{job_id}/complete", runner_complete)
    r.add_post("/_standin/runner/heartbeat", runner_heartbeat)

    async def _start_expiry(app: web.Application) -> None:
        app[TASKS_KEY].add(asyncio.get_running_loop().create_task(_expiry_loop(app)))

    async def _cancel_tasks(app: web.Application) -> None:
        tasks: set[asyncio.Task[None]] = app[TASKS_KEY]
        for task in list(tasks):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    app.on_startup.append(_start_expiry)
    app.on_shutdown.append(_cancel_tasks)
    return app
