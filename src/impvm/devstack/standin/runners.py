"""The GitHub stand-in's runner routes: runner groups, JIT configs (org and repository
``generate-jitconfig``) and listing, reading and deleting runners."""

from __future__ import annotations

import json

from aiohttp import web

from impvm.devstack.standin.auth import require
from impvm.devstack.standin.common import ApiError, org_of, paged, repo_of, state_of
from impvm.devstack.standin.records import RunnerRec

#: GitHub's limit on a runner name (characters); a longer JIT request name is answered 422.
MAX_RUNNER_NAME = 64


async def list_runner_groups(request: web.Request) -> web.Response:
    state = state_of(request)
    org = org_of(request)
    require(request, "organization_self_hosted_runners", "read", org)
    groups = sorted((g for g in state.runner_groups.values() if g.org == org), key=lambda g: g.id)
    return paged(request, [state.runner_group(g) for g in groups], "runner_groups")


async def _jit(request: web.Request, org: str | None, repo: str | None) -> web.Response:
    state = state_of(request)
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
    org = org_of(request)
    require(request, "organization_self_hosted_runners", "write", org)
    return await _jit(request, org, None)


async def repo_jit(request: web.Request) -> web.Response:
    repo = repo_of(request)
    require(request, "administration", "write", repo.split("/")[0])
    return await _jit(request, None, repo)


def _scope(request: web.Request, level: str) -> tuple[str | None, str | None]:
    if "org" in request.match_info:
        org = org_of(request)
        require(request, "organization_self_hosted_runners", level, org)
        return org, None
    repo = repo_of(request)
    require(request, "administration", level, repo.split("/")[0])
    return None, repo


def _find_runner(request: web.Request, org: str | None, repo: str | None) -> RunnerRec:
    state = state_of(request)
    try:
        runner = state.runners[int(request.match_info["runner_id"])]
    except (KeyError, ValueError):
        raise ApiError(404, "Not Found") from None
    if runner.org != org or runner.repo != repo:
        raise ApiError(404, "Not Found")
    return runner


async def list_runners(request: web.Request) -> web.Response:
    state = state_of(request)
    org, repo = _scope(request, "read")
    name = request.query.get("name")
    runners = [
        state.runner(r)
        for r in sorted(state.runners.values(), key=lambda r: r.id)
        if r.org == org and r.repo == repo and (name is None or r.name == name)
    ]
    return paged(request, runners, "runners")


async def get_runner(request: web.Request) -> web.Response:
    org, repo = _scope(request, "read")
    return web.json_response(state_of(request).runner(_find_runner(request, org, repo)))


async def delete_runner(request: web.Request) -> web.Response:
    state = state_of(request)
    org, repo = _scope(request, "write")
    runner = _find_runner(request, org, repo)
    if runner.busy:
        raise ApiError(422, f'Bad request - Runner "{runner.name}" is still running a job".')
    del state.runners[runner.id]
    return web.Response(status=204)
