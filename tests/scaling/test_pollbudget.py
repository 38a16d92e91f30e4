"""The poll budget's pure parts: which repositories a poll reads, and the token buckets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.scaling.pollbudget import (
    BASE_REPO_COST,
    Bucket,
    PollBudget,
    RateWindow,
    choose_repos,
    cold_reserve,
    repo_cost,
    sweep_polls,
)

REPOS = st.lists(st.integers(0, 999), unique=True, max_size=60).map(
    lambda ids: [f"org/r{i:03d}" for i in sorted(ids)]
)


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[str], set[str], dict[str, int], dict[str, int], int]:
    repos = draw(REPOS)
    hot = set(draw(st.lists(st.sampled_from(repos), unique=True))) if repos else set()
    cost = {r: draw(st.integers(0, 40)) for r in repos if draw(st.booleans())}
    last = {r: draw(st.integers(0, 50)) for r in repos if draw(st.booleans())}
    return repos, hot, cost, last, draw(st.integers(-5, 300))


@given(worlds())
def test_a_poll_never_exceeds_its_budget_but_to_read_one_oversized_hot_repo(
    w: tuple[list[str], set[str], dict[str, int], dict[str, int], int],
) -> None:
    repos, hot, cost, last, budget = w
    choice = choose_repos(repos, hot, cost, last, budget)
    assert len(set(choice.read)) == len(choice.read) and set(choice.read) <= set(repos)
    spent = sum(repo_cost(r, cost) for r in choice.read)
    assert spent == choice.cost
    if spent > max(budget, 0):  # the one exception: the oldest hot repository alone, too big to fit
        assert budget > 0 and len(choice.read) == 1 and choice.read[0] in hot
        oldest = min(hot, key=lambda r: (last.get(r, -1), r))
        assert choice.read[0] == oldest
    if budget <= 0:
        assert choice.read == ()


@given(worlds())
def test_hot_repositories_are_read_every_poll_when_they_fit(
    w: tuple[list[str], set[str], dict[str, int], dict[str, int], int],
) -> None:
    repos, hot, cost, last, budget = w
    room = budget - cold_reserve(budget) if set(repos) - hot else budget
    if sum(repo_cost(r, cost) for r in hot) <= room:
        assert hot <= set(choose_repos(repos, hot, cost, last, budget).read)


@settings(max_examples=60)
@given(
    st.integers(1, 600),
    st.integers(0, 8),
    st.integers(2 * BASE_REPO_COST + 5, 200),
    st.integers(0, 5),
)
def test_every_repository_is_read_within_the_sweep_bound(
    n_cold: int, n_hot: int, budget: int, hot_runs: int
) -> None:
    """Polls in a row with a fixed budget: every cold repository is read at least once in every
    window of sweep_polls(...) polls, every hot one in every poll (when they fit)."""
    cold = [f"org/c{i:03d}" for i in range(n_cold)]
    hot = {f"org/h{i}" for i in range(n_hot)}
    repos = sorted(cold + list(hot))
    cost = {h: BASE_REPO_COST + hot_runs for h in hot}
    hot_cost = sum(cost.values())
    bound = sweep_polls(n_cold, hot_cost, budget)
    if bound is None:
        return
    last: dict[str, int] = {}
    gaps: dict[str, int] = {}
    for n in range(1, 3 * bound + 2):
        choice = choose_repos(repos, hot, cost, last, budget)
        assert choice.cost <= budget
        if hot_cost <= budget - cold_reserve(budget):
            assert hot <= set(choice.read)
        for r in choice.read:
            gaps[r] = max(gaps.get(r, 0), n - last.get(r, 0))
            last[r] = n
        for r in cold:  # none waits longer than the bound
            assert n - last.get(r, 0) < bound + 1
    assert all(gaps[r] <= bound for r in cold)


def test_sweep_math_for_50_and_500_repositories() -> None:
    per_poll = PollBudget().per_poll(30)
    assert per_poll == 150
    assert sweep_polls(50, 0, per_poll, listing_pages=1) == 1
    assert sweep_polls(500, 0, per_poll, listing_pages=5) == math.ceil(500 / 72) == 7
    assert sweep_polls(10, 149, 150) == 1  # the reserve: 75 requests, 37 idle repositories
    assert sweep_polls(100, 1000, 150) == 3
    assert sweep_polls(10, 0, 1) is None
    assert sweep_polls(0, 0, 10) == 0


@given(
    st.floats(1, 100_000),
    st.floats(1, 600),
    st.lists(st.tuples(st.floats(0, 120), st.integers(0, 500)), max_size=40),
)
def test_spending_within_the_bucket_holds_the_hourly_rate(
    per_hour: float, burst: float, polls: list[tuple[float, int]]
) -> None:
    """A poller that spends only while its bucket is positive, at most one poll's overrun at a
    time, makes at most per_hour * T / 3600 + the cap + that overrun in any run of T seconds."""
    b = Bucket.full(per_hour, burst, 0.0)
    cap = per_hour * burst / 3600
    t, spent, overrun = 0.0, 0, 0
    for dt_, want in polls:
        t += dt_
        b = b.refilled(per_hour, burst, t)
        assert b.tokens <= cap + 1e-6
        allowed = math.floor(b.tokens)
        if allowed <= 0:
            continue
        used = want if want <= allowed else allowed + min(want - allowed, 50)
        overrun = max(overrun, used - allowed)
        spent += used
        b = b.spent(used)
    assert spent <= per_hour * t / 3600 + cap + overrun + 1e-6


def test_a_bucket_refills_to_its_cap_and_ignores_a_clock_going_back() -> None:
    b = Bucket(0.0, 100.0)
    assert b.refilled(3600, 10, 105.0).tokens == 5.0
    assert b.refilled(3600, 10, 1000.0).tokens == 10.0
    assert b.refilled(3600, 10, 50.0).tokens == 0.0
    assert Bucket(-20.0, 0.0).refilled(3600, 10, 5.0).tokens == -15.0


@pytest.mark.parametrize(
    "bad", [{"calls_per_hour": 0.0}, {"rate_limit_share": 0.0}, {"rate_limit_share": 1.5}]
)
def test_budget_settings_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PollBudget(**bad)


def test_a_rate_window_counts_per_github_window() -> None:
    w = RateWindow().at(0).charged(30)  # before GitHub said when its window resets
    assert w.left(0.5, 100) == 20
    w = w.at(5000)  # the first window learnt: what was used counts in it
    assert (w.used, w.left(0.5, 100)) == (30, 20)
    w = w.charged(25)
    assert w.left(0.5, 100) == -5
    assert w.at(5000).used == 55 and w.at(8600).used == 0  # a new window starts from zero
