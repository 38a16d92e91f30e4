"""Async GitHub REST client for the operator: JIT configs, runner groups, runners, runs and jobs,
the installation's repositories, rate limits. Each endpoint is one method over
:class:`impvm.github.reads.GitHubReads` (auth, retries, rate-limit waits; conditional
reads); an endpoint that exists for an organisation and a repository takes a :class:`Scope` and
resolves its path once (:func:`_at`).

Sources: GitHub REST docs "Self-hosted runners" (JIT config, list/get/delete runners),
"Self-hosted runner groups", "Workflow runs", "Workflow jobs", "Installations" (list
repositories accessible to the app installation) and "Rate limit".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

from githubkit import Response
from pydantic import SecretStr

from impvm.github.auth import Permissions
from impvm.github.convert import job_of, run_of, runner_of
from impvm.github.errors import NotFound, RequestRejected
from impvm.github.reads import GitHubReads
from impvm.github.types import (
    DeleteOutcome,
    JitConfig,
    Listed,
    RateLimitBucket,
    Repository,
    Runner,
    RunStatus,
    Scope,
    WorkflowJob,
    WorkflowRun,
)

#: a githubkit endpoint method: called with the scope's path arguments, then the endpoint's own
#: arguments
ScopedCall: TypeAlias = Callable[..., Awaitable[Response[Any, Any]]]


def _at(scope: Scope, path: str, org_call: ScopedCall, repo_call: ScopedCall) -> _Scoped:
    """The organisation's or the repository's form of one endpoint: ``path`` below
    ``/orgs/{org}/actions/`` or ``/repos/{owner}/{repo}/actions/`` (GitHub REST docs, "Self-hosted
    runners": every runner endpoint exists in both forms, with the same body and answers)."""
    if scope.org is not None:
        return _Scoped("/orgs/{org}/actions/" + path, (scope.org,), org_call)
    owner, repo = scope.owner_repo
    return _Scoped("/repos/{owner}/{repo}/actions/" + path, (owner, repo), repo_call)


@dataclass(frozen=True)
class _Scoped:
    """One endpoint resolved for a scope: ``endpoint`` (the path template, for errors and
    metrics), the scope's path arguments, and the githubkit method to call."""

    endpoint: str
    args: tuple[str, ...]
    call: ScopedCall

    def __call__(self, *rest: Any, **kwargs: Any) -> Awaitable[Response[Any, Any]]:
        return self.call(*self.args, *rest, **kwargs)


class GitHubClient(GitHubReads):
    """Async GitHub REST client for one set of credentials (one App installation or one PAT).

    ``credentials``: :class:`AppCredentials` or :class:`PatCredentials`. ``server_url``: the
    pool's ``platform.serverURL`` (see :func:`api_base_url`); ``api_url`` overrides the computed
    base. ``timeout`` is seconds per request. ``sleep``/``clock``/``rng`` are injectable for
    tests (defaults: ``asyncio.sleep``, ``time.time``, ``random.random``). ``page_size`` is the
    ``per_page`` of list calls (GitHub max 100). ``etag_cache_size`` bounds the conditional-
    request cache (entries, least recently used dropped): a poll of 500 repositories keeps two
    run listings each, so it must hold more than the pages one poll sweep reads.

    Each method requests an installation token with only the permissions it needs (e.g. JIT for
    an org: ``organization_self_hosted_runners: write``; repo: ``administration: write``;
    runs/jobs: ``actions: read``) unless the client was restricted with
    :meth:`with_permissions`. Tokens are cached per permission set until
    ``token_refresh_margin`` seconds before ``expires_at``.

    Errors: every method raises only :class:`impvm.github.errors.GitHubError` subclasses.
    Call :meth:`close` (or use ``async with``) when done.
    """

    # ------------------------------------------------------------------ runner groups

    async def runner_group_id(self, org: str, name: str | None = None) -> int:
        """Id of the org runner group ``name``; ``None`` -> the group with ``default: true``.
        Reads all pages. Raises :class:`NotFound` if no such group.
        Source: REST "Self-hosted runner groups" (list self-hosted runner groups for an org);
        needs ``organization_self_hosted_runners: read``."""
        gh = self._shared.gh
        endpoint = "/orgs/{org}/actions/runner-groups"
        groups = await self._paginate(
            endpoint,
            self._perms({"organization_self_hosted_runners": "read"}),
            ("runner-groups", org),
            lambda p, n, h: gh.rest.actions.async_list_self_hosted_runner_groups_for_org(
                org, per_page=n, page=p, headers=h
            ),
            lambda d: d.runner_groups,
            lambda d: d.total_count,
        )
        for group in groups:
            if (name is None and group.default) or (name is not None and group.name == name):
                return int(group.id)
        wanted = "default runner group" if name is None else f"runner group {name!r}"
        raise NotFound(f"{wanted} not found in org {org}", endpoint=endpoint, status=404)

    # ------------------------------------------------------------------ runners

    async def generate_jitconfig(
        self,
        scope: Scope,
        name: str,
        runner_group_id: int,
        labels: Sequence[str],
        work_folder: str = "_work",
    ) -> JitConfig:
        """Create a JIT runner configuration (``POST .../actions/runners/generate-jitconfig``).

        ``name`` must be unique in the scope (else :class:`Conflict`, 409); ``labels`` are the
        pool's labels (GitHub requires 1..100; empty -> ``["self-hosted"]``). For a repo scope
        use :data:`REPO_RUNNER_GROUP_ID`. Needs ``organization_self_hosted_runners: write``
        (org) or ``administration: write`` (repo). Not idempotent: a retried request that had
        succeeded surfaces as :class:`Conflict`.
        Source: REST "Self-hosted runners", create configuration for a just-in-time runner."""
        gh = self._shared.gh
        body: dict[str, Any] = {
            "name": name,
            "runner_group_id": runner_group_id,
            "labels": list(labels) or ["self-hosted"],
            "work_folder": work_folder,
        }
        at = _at(
            scope,
            "runners/generate-jitconfig",
            gh.rest.actions.async_generate_runner_jitconfig_for_org,
            gh.rest.actions.async_generate_runner_jitconfig_for_repo,
        )
        resp = await self._send(
            at.endpoint,
            "POST",
            self._runner_perms(scope, "write"),
            lambda h: at(headers=h, data=cast(Any, body)),
        )
        data: Any = resp.parsed_data
        return JitConfig(
            runner_id=int(data.runner.id),
            runner_name=str(data.runner.name),
            encoded_jit_config=SecretStr(data.encoded_jit_config),
        )

    def _runner_perms(self, scope: Scope, level: str) -> Permissions:
        if scope.org is not None:
            return self._perms({"organization_self_hosted_runners": level})
        return self._perms({"administration": level})

    async def list_runners(self, scope: Scope, name_prefix: str = "") -> list[Runner]:
        """All self-hosted runners of the scope whose name starts with ``name_prefix``
        (all pages; ETag-revalidated). Source: REST "Self-hosted runners", list runners."""
        gh = self._shared.gh
        at = _at(
            scope,
            "runners",
            gh.rest.actions.async_list_self_hosted_runners_for_org,
            gh.rest.actions.async_list_self_hosted_runners_for_repo,
        )
        models = await self._paginate(
            at.endpoint,
            self._runner_perms(scope, "read"),
            ("runners", str(scope)),
            lambda p, n, h: at(per_page=n, page=p, headers=h),
            lambda d: d.runners,
            lambda d: d.total_count,
        )
        return [runner_of(m) for m in models if str(m.name).startswith(name_prefix)]

    async def get_runner(self, scope: Scope, runner_id: int) -> Runner | None:
        """One runner, or ``None`` if GitHub no longer knows it (404).
        Source: REST "Self-hosted runners", get a self-hosted runner."""
        gh = self._shared.gh
        at = _at(
            scope,
            "runners/{runner_id}",
            gh.rest.actions.async_get_self_hosted_runner_for_org,
            gh.rest.actions.async_get_self_hosted_runner_for_repo,
        )
        try:
            resp = await self._send(
                at.endpoint,
                "GET",
                self._runner_perms(scope, "read"),
                lambda h: at(runner_id, headers=h),
            )
        except NotFound:
            return None
        return runner_of(resp.parsed_data)

    async def delete_runner(self, scope: Scope, runner_id: int) -> DeleteOutcome:
        """Remove a runner registration: 204 -> ``DELETED``; 422 (runner still running a job)
        -> ``BUSY``; 404 -> ``NOT_FOUND``. Other failures raise.
        Source: REST "Self-hosted runners", delete a self-hosted runner."""
        gh = self._shared.gh
        at = _at(
            scope,
            "runners/{runner_id}",
            gh.rest.actions.async_delete_self_hosted_runner_from_org,
            gh.rest.actions.async_delete_self_hosted_runner_from_repo,
        )
        try:
            await self._send(
                at.endpoint,
                "DELETE",
                self._runner_perms(scope, "write"),
                lambda h: at(runner_id, headers=h),
            )
        except NotFound:
            return DeleteOutcome.NOT_FOUND
        except RequestRejected as exc:
            if exc.status == 422:
                return DeleteOutcome.BUSY
            raise
        return DeleteOutcome.DELETED

    # ------------------------------------------------------------------ runs and jobs

    @staticmethod
    def _split(repo: str) -> tuple[str, str]:
        return Scope(repo=repo).owner_repo

    async def list_runs(self, repo: str, status: RunStatus) -> list[WorkflowRun]:
        """Workflow runs of ``repo`` (``owner/name``) with ``status`` (all pages, ETag).
        Needs ``actions: read``. Source: REST "Workflow runs", list workflow runs for a repo."""
        return (await self.read_runs(repo, status)).items

    async def read_runs(self, repo: str, status: RunStatus) -> Listed[WorkflowRun]:
        """:meth:`list_runs` with the requests it made and the 304s among them."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        listed = await self._paginate_conditional(
            "/repos/{owner}/{repo}/actions/runs",
            self._perms({"actions": "read"}),
            ("runs", repo, status),
            lambda p, n, h: gh.rest.actions.async_list_workflow_runs_for_repo(
                owner, name, status=status, per_page=n, page=p, headers=h
            ),
            lambda d: d.workflow_runs,
            lambda d: d.total_count,
        )
        return Listed([run_of(m) for m in listed.items], listed.calls, listed.not_modified)

    async def list_run_jobs(
        self, repo: str, run_id: int, filter: Literal["latest", "all"] = "latest"
    ) -> list[WorkflowJob]:
        """Jobs of a workflow run (all pages, ETag). ``filter``: ``latest`` attempt or ``all``.
        Needs ``actions: read``. Source: REST "Workflow jobs", list jobs for a workflow run."""
        return (await self.read_run_jobs(repo, run_id, filter)).items

    async def read_run_jobs(
        self, repo: str, run_id: int, filter: Literal["latest", "all"] = "latest"
    ) -> Listed[WorkflowJob]:
        """:meth:`list_run_jobs` with the requests it made and the 304s among them."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        listed = await self._paginate_conditional(
            "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs",
            self._perms({"actions": "read"}),
            ("jobs", repo, run_id, filter),
            lambda p, n, h: gh.rest.actions.async_list_jobs_for_workflow_run(
                owner, name, run_id, filter_=filter, per_page=n, page=p, headers=h
            ),
            lambda d: d.jobs,
            lambda d: d.total_count,
        )
        return Listed([job_of(m) for m in listed.items], listed.calls, listed.not_modified)

    async def get_run(self, repo: str, run_id: int) -> WorkflowRun | None:
        """One workflow run, ``None`` on 404. Source: REST "Workflow runs", get a run."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        try:
            data = await self._get(
                "/repos/{owner}/{repo}/actions/runs/{run_id}",
                self._perms({"actions": "read"}),
                ("run", repo, run_id),
                lambda h: gh.rest.actions.async_get_workflow_run(owner, name, run_id, headers=h),
            )
        except NotFound:
            return None
        return run_of(data)

    async def get_job(self, repo: str, job_id: int) -> WorkflowJob | None:
        """One workflow job, ``None`` on 404. Source: REST "Workflow jobs", get a job."""
        gh = self._shared.gh
        owner, name = self._split(repo)
        try:
            data = await self._get(
                "/repos/{owner}/{repo}/actions/jobs/{job_id}",
                self._perms({"actions": "read"}),
                ("job", repo, job_id),
                lambda h: gh.rest.actions.async_get_job_for_workflow_run(
                    owner, name, job_id, headers=h
                ),
            )
        except NotFound:
            return None
        return job_of(data)

    # ------------------------------------------------------------------ installation

    async def list_installation_repos(self) -> list[Repository]:
        """Repositories the installation can access (all pages, ETag).
        Source: REST "Installations", list repositories accessible to the app installation."""
        return (await self.read_installation_repos()).items

    async def read_installation_repos(self) -> Listed[Repository]:
        """:meth:`list_installation_repos` with the requests it made and the 304s among them."""
        gh = self._shared.gh
        listed = await self._paginate_conditional(
            "/installation/repositories",
            self._perms({"metadata": "read"}),
            ("installation-repos",),
            lambda p, n, h: gh.rest.apps.async_list_repos_accessible_to_installation(
                per_page=n, page=p, headers=h
            ),
            lambda d: d.repositories,
            lambda d: d.total_count,
        )
        repos = [
            Repository(
                id=int(m.id),
                full_name=str(m.full_name),
                owner=str(m.owner.login),
                name=str(m.name),
                private=bool(m.private),
            )
            for m in listed.items
        ]
        return Listed(repos, listed.calls, listed.not_modified)

    async def rate_limit(self) -> dict[str, RateLimitBucket]:
        """``GET /rate_limit``: buckets by resource (``core``, ``search``, ...). Does not count
        against the primary rate limit. Source: REST "Rate limit"."""
        gh = self._shared.gh
        resp = await self._send(
            "/rate_limit",
            "GET",
            self._perms({"metadata": "read"}),
            lambda h: gh.rest.rate_limit.async_get(headers=h),
        )
        resources = resp.parsed_data.resources
        out: dict[str, RateLimitBucket] = {}
        for name, bucket in resources.model_dump(exclude_none=True).items():
            if isinstance(bucket, dict) and {"limit", "remaining", "used", "reset"} <= set(bucket):
                out[name] = RateLimitBucket(
                    limit=int(bucket["limit"]),
                    remaining=int(bucket["remaining"]),
                    used=int(bucket["used"]),
                    reset=int(bucket["reset"]),
                )
        return out
