"""githubkit's response models -> this package's values (:mod:`impvm.github.types`): the one
place that reads githubkit's field names, so the endpoints and their callers see only typed
values."""

from __future__ import annotations

from typing import Any

from githubkit.utils import UNSET

from impvm.github.types import Runner, WorkflowJob, WorkflowRun


def opt(value: Any) -> Any:
    """None for githubkit's UNSET (a field the answer left out), else the value."""
    return None if value is UNSET else value


def runner_of(model: Any) -> Runner:
    """A githubkit runner model -> :class:`Runner`."""
    return Runner(
        id=int(model.id),
        name=str(model.name),
        status=str(model.status),
        busy=bool(model.busy),
        labels=tuple(label.name for label in model.labels),
        os=str(model.os),
        runner_group_id=opt(model.runner_group_id),
        ephemeral=opt(model.ephemeral),
    )


def run_of(model: Any) -> WorkflowRun:
    """A githubkit workflow run model -> :class:`WorkflowRun`."""
    return WorkflowRun(
        id=int(model.id),
        name=opt(model.name),
        status=model.status,
        conclusion=model.conclusion,
        repository=str(model.repository.full_name),
        run_attempt=opt(model.run_attempt),
        event=str(model.event),
        head_branch=model.head_branch,
        created_at=model.created_at,
        updated_at=model.updated_at,
    )


def job_of(model: Any) -> WorkflowJob:
    """A githubkit workflow job model -> :class:`WorkflowJob`."""
    return WorkflowJob(
        id=int(model.id),
        run_id=int(model.run_id),
        name=str(model.name),
        status=str(model.status),
        conclusion=model.conclusion,
        labels=tuple(model.labels),
        runner_id=model.runner_id,
        runner_name=model.runner_name,
        runner_group_id=model.runner_group_id,
        workflow_name=model.workflow_name,
        head_branch=model.head_branch,
        created_at=model.created_at,
        started_at=model.started_at,
        completed_at=model.completed_at,
    )
