"""Unit tests of impvm.scaling.labels (which pool a job belongs to)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impvm.scaling import (
    DEFAULT_RUNNER_LABELS,
    PoolLabels,
    choose_pool,
    job_matches,
)
from impvm.scaling.labels import fitting_pools


@pytest.mark.parametrize(
    ("job", "pool", "matches"),
    [
        (["self-hosted", "linux", "imp"], ["imp"], True),
        (["self-hosted"], ["imp"], True),
        (["imp"], ["imp"], True),
        (["self-hosted", "linux", "x64", "imp"], ["imp"], True),
        (["self-hosted", "linux", "imp", "gpu"], ["imp"], False),
        (["self-hosted", "linux", "imp", "gpu"], ["imp", "gpu"], True),
        (["SELF-HOSTED", "Linux", "IMP"], ["imp"], True),
        (["imp"], ["IMP"], True),
        (["self-hosted", "windows"], ["imp"], False),
        (["self-hosted", "arm64"], ["imp"], False),
        (["ubuntu-latest"], ["imp"], False),
        (["imp"], [], False),
        (["self-hosted", "linux"], [], True),
        ([], ["imp"], False),  # empty label list matches nothing (documented)
        ([], [], False),
    ],
)
def test_job_matches(job: list[str], pool: list[str], matches: bool) -> None:
    assert job_matches(job, pool) is matches


def test_runner_labels_are_a_parameter() -> None:
    assert not job_matches(["self-hosted", "arm64", "imp"], ["imp"])
    assert job_matches(["self-hosted", "arm64", "imp"], ["imp"], {"self-hosted", "linux", "ARM64"})
    assert not job_matches(["linux", "imp"], ["imp"], runner_labels=())
    assert DEFAULT_RUNNER_LABELS == {"self-hosted", "linux", "x64"}


SMALL = PoolLabels(namespace="ci", name="small", labels=("imp",))
BIG = PoolLabels(namespace="ci", name="big", labels=("imp", "large"))
GPU = PoolLabels(namespace="ci", name="gpu", labels=("imp", "GPU"))


def test_choose_pool_prefers_the_tightest_fit() -> None:
    pools = [BIG, SMALL, GPU]
    assert choose_pool(["self-hosted", "imp"], pools) == SMALL
    assert choose_pool(["self-hosted", "imp", "large"], pools) == BIG
    assert choose_pool(["imp", "gpu"], pools) == GPU
    assert choose_pool(["imp", "gpu", "large"], pools) is None
    assert choose_pool([], pools) is None
    assert choose_pool(["imp"], []) is None


def test_choose_pool_ties_go_to_the_oldest_pool_never_by_name() -> None:
    old = PoolLabels(namespace="z-team", name="z", labels=("imp",), created=100.0, uid="u2")
    new = PoolLabels(namespace="a-team", name="a", labels=("imp",), created=200.0, uid="u1")
    same_age = PoolLabels(namespace="a", name="a", labels=("IMP", "imp"), created=100.0, uid="u1")
    assert choose_pool(["imp"], [new, old]) == old  # "a-team" sorts first but came later
    assert choose_pool(["imp"], [old, same_age]) == same_age  # then the uid, never the name
    assert fitting_pools(["imp"], [new, old, same_age]) == [same_age, old, new]
    tight = PoolLabels(namespace="m", name="m", labels=("imp", "large"), created=1.0)
    assert choose_pool(["imp", "large"], [new, tight]) == tight  # the tightest fit comes first


@given(
    st.permutations(["a", "b", "c"]),
    st.lists(st.floats(0, 1e9, allow_nan=False), min_size=3, max_size=3, unique=True),
)
def test_prop_no_name_wins_a_tie(names: list[str], created: list[float]) -> None:
    """Renaming the namespaces of equally fitting pools never changes which one a job goes
    to: the oldest, whatever it is called."""
    pools = [
        PoolLabels(namespace=n, name="pool", labels=("imp",), created=c, uid=f"uid-{i}")
        for i, (n, c) in enumerate(zip(names, created, strict=True))
    ]
    chosen = choose_pool(["imp"], pools)
    assert chosen is not None and chosen.created == min(created)


LABELS = st.sampled_from(["imp", "gpu", "large", "linux", "x64", "self-hosted", "arm64", "Imp"])
POOLS = st.lists(
    st.builds(
        PoolLabels,
        namespace=st.sampled_from(["a", "b"]),
        name=st.sampled_from(["p", "q", "r"]),
        labels=st.lists(LABELS, max_size=4).map(tuple),
    ),
    max_size=6,
    unique_by=lambda p: (p.namespace, p.name),
)


def _swap(label: str, upper: bool) -> str:
    return label.upper() if upper else label.lower()


@given(st.lists(LABELS, max_size=5), st.lists(LABELS, max_size=4), st.booleans())
def test_prop_matching_is_case_insensitive(job: list[str], pool: list[str], upper: bool) -> None:
    assert job_matches(job, pool) == job_matches([_swap(x, upper) for x in job], pool)
    assert job_matches(job, pool) == job_matches(job, [_swap(x, not upper) for x in pool])


@given(st.lists(LABELS, max_size=5), POOLS, st.randoms(use_true_random=False))
def test_prop_choice_is_a_matching_tightest_pool_independent_of_order(
    job: list[str], pools: list[PoolLabels], rnd: random.Random
) -> None:
    chosen = choose_pool(job, pools)
    shuffled = list(pools)
    rnd.shuffle(shuffled)
    assert choose_pool(job, shuffled) == chosen
    matching = [p for p in pools if job_matches(job, p.labels)]
    if chosen is None:
        assert matching == []
        return
    assert chosen in matching

    def size(p: PoolLabels) -> int:
        return len({x.casefold() for x in p.labels} - DEFAULT_RUNNER_LABELS)

    assert all(size(chosen) <= size(p) for p in matching)
