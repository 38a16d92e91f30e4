"""Which pool a queued GitHub Actions job belongs to (pure).

GitHub routes a job to a self-hosted runner only when *every* label in the job's ``runs-on`` is
one of the runner's labels, compared case-insensitively ("Choosing the runner for a job",
GitHub Docs: "a job runs on a runner whose labels match all the labels in runs-on"). A runner
made from a pool reports the pool's ``spec.labels`` plus ``self-hosted`` and the platform and
architecture labels the runner program adds itself (``linux``, ``x64`` for our VMs).

Nothing here does I/O; the poller and the webhook receiver call these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from impvm.api.models import PoolKey

__all__ = [
    "DEFAULT_RUNNER_LABELS",
    "PoolLabels",
    "choose_pool",
    "fitting_pools",
    "job_matches",
    "normalise_labels",
]

#: Labels every pool runner reports besides the pool's own: ``self-hosted`` (GitHub adds it to
#: every self-hosted runner; we also pass it in the JIT request) and the
#: operating system and architecture labels the runner program reports for our Linux x86-64 VMs.
DEFAULT_RUNNER_LABELS: frozenset[str] = frozenset({"self-hosted", "linux", "x64"})


def normalise_labels(labels: Iterable[str]) -> frozenset[str]:
    """Case-fold ``labels`` into a set (GitHub compares runner labels case-insensitively)."""
    return frozenset(label.casefold() for label in labels)


def _effective(pool_labels: Iterable[str], runner_labels: Iterable[str]) -> frozenset[str]:
    return normalise_labels(pool_labels) | normalise_labels(runner_labels)


def job_matches(
    job_labels: Iterable[str],
    pool_labels: Iterable[str],
    runner_labels: Iterable[str] = DEFAULT_RUNNER_LABELS,
) -> bool:
    """Whether a job with ``job_labels`` (its ``runs-on``) can run on a runner of a pool.

    True when every job label, case-folded, is in the union of ``pool_labels`` and
    ``runner_labels`` (case-folded; ``runner_labels`` defaults to
    :data:`DEFAULT_RUNNER_LABELS`). Source: GitHub Docs "Choosing the runner for a job".

    An **empty** ``job_labels`` matches nothing: GitHub never queues a job without a label (a
    ``runs-on`` is required), so an empty list means the caller lost the labels, and routing such
    a job to an arbitrary pool would start VMs for a job that may not be ours.
    """
    wanted = normalise_labels(job_labels)
    if not wanted:
        return False
    return wanted <= _effective(pool_labels, runner_labels)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolLabels:
    """A pool as seen by job routing: ``namespace``/``name``, its ``spec.labels``, and what
    breaks a tie between pools that fit a job equally well: ``created`` (the pool's
    ``metadata.creationTimestamp``, epoch seconds) and ``uid`` (both set by the API server, so
    no tenant chooses them)."""

    namespace: str
    name: str
    labels: tuple[str, ...] = ()
    created: float = 0.0
    uid: str = ""

    @property
    def key(self) -> PoolKey:
        """The pool's identity, without its labels."""
        return PoolKey(self.namespace, self.name)


def _size(pool: PoolLabels, implicit: frozenset[str]) -> int:
    return len(normalise_labels(pool.labels) - implicit)


def _rank(pool: PoolLabels, implicit: frozenset[str]) -> tuple[int, float, str, str, str]:
    return (_size(pool, implicit), pool.created, pool.uid, pool.namespace, pool.name)


def fitting_pools(
    job_labels: Iterable[str],
    pools: Sequence[PoolLabels],
    runner_labels: Iterable[str] = DEFAULT_RUNNER_LABELS,
) -> list[PoolLabels]:
    """The pools a job fits best, in the order :func:`choose_pool` takes them: every pool the
    job matches (:func:`job_matches`) with the fewest distinct labels. More than one is a tie
    (``impvm_job_routing_ties_total`` counts it)."""
    job = list(job_labels)
    implicit = normalise_labels(runner_labels)
    candidates = [p for p in pools if job_matches(job, p.labels, implicit)]
    if not candidates:
        return []
    tightest = min(_size(p, implicit) for p in candidates)
    return sorted(
        (p for p in candidates if _size(p, implicit) == tightest),
        key=lambda p: _rank(p, implicit),
    )


def choose_pool(
    job_labels: Iterable[str],
    pools: Sequence[PoolLabels],
    runner_labels: Iterable[str] = DEFAULT_RUNNER_LABELS,
) -> PoolLabels | None:
    """The one pool a job belongs to, or None when no pool matches (see :func:`job_matches`).

    A job matching several pools goes to exactly one, deterministically: the pool with the fewest
    distinct labels (the tightest fit, so a big runner does not take a small job); among pools
    that fit equally, the **oldest** (``created``), then the lowest ``uid``. Both are the API
    server's, so no tenant wins a tie by choosing a namespace or pool name, and a pool created
    later never takes jobs from one that was there first (the ``(namespace, name)`` order is
    only the last resort, for entries without creation time and uid). Labels a pool repeats, or
    that every runner reports anyway (``runner_labels``), do not count towards its size.

    ``pools`` must already be restricted to pools whose ``platform.scope`` covers the job's
    repository and whose credentials are the job's installation (the caller knows them; this
    function only compares labels).
    """
    best = fitting_pools(job_labels, pools, runner_labels)
    return best[0] if best else None
