"""Traces: the generator's shape and determinism, the bundled trace is what the generator makes,
CSV and JSON read back what was written, and bad input gets one line naming the row and field."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from impvm.sim.cli import BUNDLED_SEED, BUNDLED_TRACE
from impvm.sim.trace import DayProfile, TraceError, dump_trace, generate, load_trace, parse_trace
from tests.conftest import REPO

BUNDLED = REPO / "src" / "impvm" / "sim" / "traces" / BUNDLED_TRACE


def test_bundled_trace_is_the_generator_output_for_its_seed() -> None:
    assert BUNDLED.read_text() == dump_trace(generate(DayProfile(), BUNDLED_SEED)), (
        "regenerate with: impvm simulate generate --seed 1 -o " + str(BUNDLED.relative_to(REPO))
    )


def test_generator_is_deterministic_per_seed() -> None:
    p = DayProfile(peak_per_minute=2, burst_size=20)
    assert generate(p, 5) == generate(p, 5)
    assert generate(p, 5) != generate(p, 6)


def test_bursty_day_has_a_quiet_night_a_ramp_a_burst_of_200_and_an_evening() -> None:
    jobs = load_trace(BUNDLED)
    day = datetime(2026, 3, 2, tzinfo=UTC)

    def count(h0: float, h1: float) -> int:
        a, b = day + timedelta(hours=h0), day + timedelta(hours=h1)
        return sum(1 for j in jobs if a <= j.queued_at < b)

    night = count(0, 6) + count(21, 24)
    assert night < 60  # ~3 an hour
    assert count(7, 8) < count(8, 9) < count(9, 10)  # morning ramp
    assert count(10, 11) > 400  # ~8 a minute
    burst_start = day + timedelta(hours=14.5)
    burst = sum(1 for j in jobs if burst_start <= j.queued_at < burst_start + timedelta(seconds=60))
    assert 200 <= burst < 215  # the burst plus the ~8 ordinary jobs of that minute
    assert count(17, 18) > count(19, 20)  # evening decline
    assert all(j.labels == ("self-hosted", "imp") and j.duration_seconds >= 0 for j in jobs)
    assert jobs == sorted(jobs, key=lambda j: j.queued_at)


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_dump_then_parse_is_identity(fmt: str) -> None:
    jobs = generate(DayProfile(peak_per_minute=1, burst_size=5), 2)
    assert parse_trace(dump_trace(jobs, fmt), "t", fmt) == jobs


def test_json_accepts_a_jobs_object_and_extra_keys_and_csv_extra_columns() -> None:
    text = (
        '{"jobs": [{"queued_at": "2026-03-02T10:00:00+01:00", "labels": ["imp"], '
        '"duration_seconds": 5, "id": 1}]}'
    )
    (job,) = parse_trace(text, "t.json", "json")
    assert job.queued_at == datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
    csv = "id,queued_at,labels,duration_seconds\n7,2026-03-02T10:00:00Z,self-hosted  imp,1.5\n"
    (job,) = parse_trace(csv, "t.csv")
    assert job.labels == ("self-hosted", "imp") and job.duration_seconds == 1.5


HEADER = "queued_at,labels,duration_seconds\n"
OK_ROW = "2026-03-02T10:00:00Z,imp,10\n"


@pytest.mark.parametrize(
    ("text", "fmt", "words"),
    [
        ("queued_at,labels\n", "csv", ["t:", "missing column duration_seconds"]),
        (HEADER, "csv", ["t: no jobs"]),
        (
            HEADER + OK_ROW + "2026-03-02T10:00:00Z,imp,-5\n",
            "csv",
            ["t line 3", "duration_seconds"],
        ),
        (HEADER + "2026-03-02T10:00:00,imp,5\n", "csv", ["t line 2", "queued_at", "timezone"]),
        (HEADER + "yesterday,imp,5\n", "csv", ["t line 2", "queued_at"]),
        (HEADER + "2026-03-02T10:00:00Z,,5\n", "csv", ["t line 2", "labels"]),
        (HEADER + "2026-03-02T10:00:00Z,imp,nan\n", "csv", ["t line 2", "duration_seconds"]),
        (HEADER + "2026-03-02T10:00:00Z,imp,5,extra\n", "csv", ["t line 2", "more fields"]),
        ("[1,", "json", ["t: not JSON", "line 1"]),
        ('{"rows": []}', "json", ["t:", "'jobs'"]),
        ("[{}]", "json", ["t [0]", "queued_at"]),
        (
            '[{"queued_at": "2026-03-02T10:00:00Z", "labels": ["imp"], "duration_seconds": 1},'
            ' {"queued_at": "2026-03-02T10:00:00Z", "labels": ["a,b"], "duration_seconds": 1}]',
            "json",
            ["t [1]", "labels.0"],
        ),
        ('{"jobs": [3]}', "json", ["t jobs[0]", "must be an object"]),
    ],
)
def test_bad_trace_is_one_line_naming_row_and_field(text: str, fmt: str, words: list[str]) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace(text, "t", fmt)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "bin.csv")
