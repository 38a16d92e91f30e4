"""``impvm simulate`` as a user runs it (a real process): the table and the JSON agree, the plot
is a PNG, the default trace is the bundled one, and bad input gets one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from impvm.sim.cli import BUNDLED_TRACE
from impvm.sim.trace import DayProfile, dump_trace, generate
from tests.conftest import REPO

POLICY_KEYS = ("fixed", "adaptive", "arc", "garm", "imp")


def impvm(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "impvm.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two hours of a small morning (about 70 jobs, a burst of 20)."""
    profile = DayProfile(peak_per_minute=1.0, burst_size=20, burst_at=8.0)
    jobs = [j for j in generate(profile, 3) if 7 <= j.queued_at.hour < 9]
    path = tmp_path_factory.mktemp("trace") / "small.csv"
    path.write_text(dump_trace(jobs))
    return path


def parse_table(out: str) -> dict[str, list[str]]:
    """Rows of the rich table by their policy cell."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 3 and cells[1] and cells[1] != "policy":
            rows[cells[1]] = cells[2:-1]
    return rows


def test_table_and_json_agree(small_trace: Path) -> None:
    table = impvm("simulate", str(small_trace), "--seed", "3")
    assert table.returncode == 0, table.stderr
    assert "small.csv" in table.stdout and "seed 3" in table.stdout
    as_json = impvm("simulate", "run", str(small_trace), "--seed", "3", "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["trace"]["jobs"] == 72 or doc["trace"]["jobs"] > 30
    assert doc["model"]["seed"] == 3 and doc["pool"]["min_idle"] == 4
    assert [p["policy"] for p in doc["policies"]] == list(POLICY_KEYS)
    rows = parse_table(table.stdout)
    assert len(rows) == 5
    for p in doc["policies"]:
        cells = rows[p["label"]]
        jobs, p50, p95, mx, idle, vm_min, peak = cells
        assert int(jobs) == p["jobs"] == doc["trace"]["jobs"]
        assert float(p50) == pytest.approx(p["p50_wait_seconds"], abs=0.051)
        assert float(p95) == pytest.approx(p["p95_wait_seconds"], abs=0.051)
        assert float(mx) == pytest.approx(p["max_wait_seconds"], abs=0.051)
        assert float(idle) == pytest.approx(p["idle_runner_minutes"], abs=0.51)
        assert float(vm_min) == pytest.approx(p["vm_minutes"], abs=0.51)
        assert int(peak) == p["peak_vms"]
        assert 0 <= p["p50_wait_seconds"] <= p["p95_wait_seconds"] <= p["max_wait_seconds"]
    by = {p["policy"]: p for p in doc["policies"]}
    # same formula, same numbers (ARC's minRunners + assigned is this decider's busy + pending
    # + minIdle); Imp counts busy runners as idle and lets jobs wait
    assert by["fixed"]["p95_wait_seconds"] == by["arc"]["p95_wait_seconds"]
    assert by["imp"]["p95_wait_seconds"] > by["fixed"]["p95_wait_seconds"]


def test_policies_options_and_plot(small_trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    r = impvm(
        "simulate",
        str(small_trace),
        "-p",
        "adaptive",
        "-p",
        "fixed",
        "--min-idle",
        "2",
        "--max-idle",
        "6",
        "--safety-percent",
        "250",
        "--boot-median",
        "20",
        "--boot-p95",
        "20",
        "-o",
        "json",
        "--plot",
        str(png),
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [p["policy"] for p in doc["policies"]] == ["adaptive", "fixed"]
    assert doc["pool"]["adaptive"]["max_idle"] == 6
    assert doc["pool"]["adaptive"]["safety_percent"] == 250
    assert doc["model"]["boot_seconds"] == {"median": 20.0, "p95": 20.0}
    assert doc["policies"][1]["label"] == "fixed minIdle=2"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    h, w, _ = matplotlib.image.imread(png).shape
    assert w > 800 and h > 600


def test_warm_pool_file_with_a_schedule(small_trace: Path, tmp_path: Path) -> None:
    wp = tmp_path / "wp.yaml"
    wp.write_text(
        "mode: fixed\n"
        "schedules:\n"
        "  - {name: morning, start: '0 7 * * *', end: '0 8 * * *', minIdle: 3}\n"
    )
    r = impvm("simulate", str(small_trace), "-p", "adaptive", "--warm-pool", str(wp), "-o", "json")
    assert r.returncode == 0, r.stderr
    (p,) = json.loads(r.stdout)["policies"]
    assert p["label"] == "fixed minIdle=0 schedules=morning:3"
    assert 100 < p["idle_runner_minutes"] < 3 * 60 + 30  # three runners idle for most of an hour


def test_default_trace_is_the_bundled_day() -> None:
    r = impvm("simulate", "-p", "arc", "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["trace"]["path"].endswith(BUNDLED_TRACE) and doc["trace"]["jobs"] > 4000


def test_generate_writes_the_bundled_trace_for_its_seed(tmp_path: Path) -> None:
    out = tmp_path / "day.csv"
    r = impvm("simulate", "generate", "--seed", "1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert (
        out.read_text() == (REPO / "src" / "impvm" / "sim" / "traces" / BUNDLED_TRACE).read_text()
    )
    as_json = impvm("simulate", "generate", "--seed", "2", "--burst-size", "5", "--format", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)[0]["labels"] == [
        "self-hosted",
        "imp",
    ]


HEADER = "queued_at,labels,duration_seconds\n"


@pytest.mark.parametrize(
    ("name", "content", "args", "words"),
    [
        (
            "bad.csv",
            HEADER + "2026-03-02T10:00:00Z,imp,5\nsoon,imp,5\n",
            [],
            ["bad.csv line 3", "queued_at"],
        ),
        ("bad.csv", "queued_at,duration_seconds\n", [], ["missing column labels"]),
        (
            "bad.json",
            '[{"queued_at": "2026-03-02T10:00:00Z", "labels": "imp"}]',
            [],
            ["bad.json [0]", "labels"],
        ),
        (
            "ok.csv",
            HEADER + "2026-03-02T10:00:00Z,imp,5\n",
            ["--boot-median", "50", "--boot-p95", "10"],
            ["--boot-median/--boot-p95"],
        ),
        ("ok.csv", HEADER + "2026-03-02T10:00:00Z,imp,5\n", ["-p", "keda"], ["--policy", "keda"]),
        (
            "ok.csv",
            HEADER + "2026-03-02T10:00:00Z,imp,5\n",
            ["--scale-up-step", "0"],
            ["--scale-up-step"],
        ),
        (
            "ok.csv",
            HEADER + "2026-03-02T10:00:00Z,imp,5\n",
            ["--max-idle", "-1"],
            ["--max-idle", "greater than or equal to 0"],
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, name: str, content: str, args: list[str], words: list[str]
) -> None:
    path = tmp_path / name
    path.write_text(content)
    r = impvm("simulate", str(path), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert r.stdout == ""


def test_bad_warm_pool_file_names_the_field(tmp_path: Path, small_trace: Path) -> None:
    wp = tmp_path / "wp.yaml"
    wp.write_text(
        "mode: adaptive\nmaxIdle: 4\nschedules:\n  - {name: x, start: '99 * * * *', end: '0 8 * * *', minIdle: 1}\n"
    )
    r = impvm("simulate", str(small_trace), "--warm-pool", str(wp))
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "warmPool.schedules.0.start" in line, line
    wp.write_text(
        "mode: adaptive\nmaxIdle: 4\nschedules:\n  - {name: x, start: '0 7 * * *', end: '0 8 * * *', timeZone: Nowhere/City, minIdle: 1}\n"
    )
    r = impvm("simulate", str(small_trace), "--warm-pool", str(wp))
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "schedules[0].timeZone" in line and "unknown time zone" in line, line


def test_missing_trace_file(tmp_path: Path) -> None:
    r = impvm("simulate", str(tmp_path / "nope.csv"))
    assert (
        r.returncode == 2 and "cannot read" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    )
