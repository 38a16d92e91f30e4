"""Run every benchmark (``webhook_to_vm``, ``qemu_boot``, ``pickup``, ``fleet`` and ``impvm
simulate``) and print one table: each figure with the baseline measured in the same run, their
ratio and the goal.

Baselines: webhook→VM against creating the ImpVM and Secret directly through the API server;
QEMU boot against the ``process`` runtime; the user's wait for a job with no idle runner
(``cold``) against the wait with one (``warm``), per runtime and pool mode; fleet creation
against direct creation of as many ImpVMs and Secrets, fleet RSS against an idle Python process
with the operator imported; the simulator's adaptive warm pool against ARC's formula (p95 wait)
and the fixed minIdle (idle runner-minutes).

Each benchmark runs as its own process with a deadline (``--timeout`` seconds each); its output
goes to ``--logs`` (default: a new temporary directory). ``--preset quick`` finishes in about
half an hour on a 2-core machine; ``full`` measures every row of the scaling table and 20 jobs of
each pickup configuration (about three hours).
``--only`` picks benchmarks by name.

    KUBEBUILDER_ASSETS=$(bash scripts/setup.sh) .venv/bin/python benchmarks/run.py --preset quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass
class Row:
    bench: str
    figure: str
    value: str
    baseline: str = ""
    ratio: str = ""
    goal: str = ""


@dataclass
class Bench:
    name: str
    argv: list[str]
    parse: Callable[[str, list[str]], list[Row]]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ""


# ---------------------------------------------------------------------- parsers

WEBHOOK_RE = re.compile(
    r"pools=\s*(\d+) samples=(\d+) webhook->VM\+Secret: median (\d+) ms p99 (\d+) ms \| "
    r"baseline direct create: median (\d+) ms p99 (\d+) ms"
)
WEBHOOK_GOAL = {1: "p99 <= 150 ms", 20: "p99 <= 250 ms", 100: "p99 <= 400 ms"}


def parse_webhook(out: str, argv: list[str]) -> list[Row]:
    rows = []
    for m in WEBHOOK_RE.finditer(out):
        pools, n, med, p99, bmed, bp99 = (int(g) for g in m.groups())
        rows.append(
            Row(
                "webhook_to_vm",
                f"webhook -> VM + Secret, {pools} pool(s), {n} samples",
                f"median {med} ms, p99 {p99} ms",
                f"median {bmed} ms, p99 {bp99} ms",
                f"median {_ratio(med, bmed)}, p99 {_ratio(p99, bp99)}",
                WEBHOOK_GOAL.get(pools, ""),
            )
        )
    return rows


BOOT_RE = re.compile(r"^(\w+): boot-to-runner-start median ([\d.]+)s over (\d+) runs", re.M)
ACCEL_RE = re.compile(r"^qemu: kernel \S+, (\w+)", re.M)
BOOT_CPU_RE = re.compile(r"^(\w+): to init median [\d.]+s, .*QEMU CPU median ([\d.]+)s", re.M)


def parse_boot(out: str, argv: list[str]) -> list[Row]:
    med = {m.group(1): float(m.group(2)) for m in BOOT_RE.finditer(out)}
    if "qemu" not in med:
        return []
    accel = ACCEL_RE.search(out)
    cpu = {m.group(1): float(m.group(2)) for m in BOOT_CPU_RE.finditer(out)}
    rows = [
        Row(
            "qemu_boot",
            f"boot to runner start, qemu ({accel.group(1) if accel else '?'})",
            f"median {med['qemu']:.2f} s",
            f"boot before the trims {med.get('baseline', 0):.2f} s",
            _ratio(med["qemu"], med.get("baseline", 0)),
            "<= 1.5 s under TCG (0.6x of 2.5 s)",
        )
    ]
    if "qemu" in cpu:
        rows.append(
            Row(
                "qemu_boot",
                "QEMU CPU to runner start",
                f"median {cpu['qemu']:.2f} s",
                f"boot before the trims {cpu.get('baseline', 0):.2f} s",
                _ratio(cpu["qemu"], cpu.get("baseline", 0)),
                "",
            )
        )
    return rows


#: the goals of the user's wait (webhook and hybrid pools; a polling pool's cold wait is bounded
#: by its interval and shown beside them)
PICKUP_GOAL = {
    ("qemu", "cold"): "p50 <= 2 s (webhook, hybrid)",
    ("process", "cold"): "p50 <= 1.5 s (webhook, hybrid)",
    ("qemu", "warm"): "p50 <= 1 s",
    ("process", "warm"): "p50 <= 1 s",
}


def parse_pickup(out: str, argv: list[str]) -> list[Row]:
    """Rows of ``pickup.py``'s ``PICKUP`` lines: cold against warm of the same runtime and
    mode (what an idle runner saves)."""
    results = [
        json.loads(ln[len("PICKUP ") :]) for ln in out.splitlines() if ln.startswith("PICKUP ")
    ]
    warm = {(r["runtime"], r["mode"], r["tree"]): r for r in results if r["demand"] == "warm"}
    rows = []
    for r in results:
        w = warm.get((r["runtime"], r["mode"], r["tree"])) if r["demand"] == "cold" else None
        rows.append(
            Row(
                "pickup",
                f"queued -> in progress, {r['runtime']} {r['demand']}, {r['mode']} pool, "
                f"n={r['n']} ({r['tree']})",
                f"p50 {r['p50']:.2f} s, p95 {r['p95']:.2f} s",
                f"warm p50 {w['p50']:.2f} s" if w else "",
                _ratio(r["p50"], w["p50"]) if w else "",
                PICKUP_GOAL.get((r["runtime"], r["demand"]), ""),
            )
        )
    return rows


def _fleet_goal(r: dict[str, Any], what: str) -> str:
    big = r["vms"] >= 1000
    return {
        "rss": "<= 200 MiB" if big else "<= 100 MiB",
        "cpu": "<= 5 %" if big else "<= 2 %",
        "calls": "<= 2 per job" if r["mode"] == "webhook" else "<= 3 per job",
        "idle": "<= 1/min per installation",
        "burst": ">= 300/min" + (" (agent running)" if r["agent"] else ""),
    }[what]


def parse_fleet(out: str, argv: list[str]) -> list[Row]:
    rows = []
    for line in out.splitlines():
        if not line.startswith("FLEET "):
            continue
        r = json.loads(line[len("FLEET ") :])
        tag = f"{r['pools']}x{r['vms_per_pool']} {r['mode']}, {r['repos']} repo(s)" + (
            ", agent" if r["agent"] else ""
        )
        base_t = r.get("baseline_create_seconds")
        rows += [
            Row(
                "fleet",
                f"{tag}: {r['vms']} VMs + JIT + Secret",
                f"{r['create_seconds']} s ({r['create_per_min']}/min), operator CPU "
                f"{r['create_cpu_seconds']} s",
                f"direct create {base_t} s" if base_t else "",
                _ratio(r["create_seconds"], base_t) if base_t else "",
                _fleet_goal(r, "burst"),
            ),
            Row(
                "fleet",
                f"{tag}: operator RSS after settling",
                f"{r['rss_mib']} MiB (peak {r['rss_peak_mib']})",
                f"idle python {r['baseline_rss_mib']} MiB" if "baseline_rss_mib" in r else "",
                _ratio(r["rss_mib"], r["baseline_rss_mib"]) if "baseline_rss_mib" in r else "",
                _fleet_goal(r, "rss"),
            ),
            Row(
                "fleet",
                f"{tag}: operator CPU, quiet {r['quiet_seconds']:.0f} s",
                f"{r['idle_cpu_share'] * 100:.1f} % of a core ({r['idle_cpu_seconds']} s)",
                f"idle python {r['baseline_idle_cpu_share'] * 100:.1f} %"
                if "baseline_idle_cpu_share" in r
                else "",
                "",
                _fleet_goal(r, "cpu"),
            ),
            Row(
                "fleet",
                f"{tag}: GitHub calls per VM created",
                f"{r['calls_per_vm']} ({r['create_calls']} calls, {r['create_calls_304']} 304s)",
                "",
                "",
                _fleet_goal(r, "calls"),
            ),
            Row(
                "fleet",
                f"{tag}: GitHub calls while idle",
                f"{r['idle_calls_per_min']}/min ({r['idle_calls_304']} 304s)",
                "",
                "",
                _fleet_goal(r, "idle"),
            ),
        ]
        p = r.get("idle_polls")
        if p and p["polls"] and r["mode"] != "webhook":
            rows.append(
                Row(
                    "fleet",
                    f"{tag}: poll cost while idle (one poller for the installation)",
                    f"{p['polls']} polls, {p['calls_per_poll_median']} requests a poll "
                    f"({p['calls_304_per_poll_median']} 304s); {p['repos_read']} repositories "
                    f"read within {p['sweep_seconds']} s",
                    "",
                    "",
                    "",
                )
            )
    return rows


def parse_sim(out: str, argv: list[str]) -> list[Row]:
    doc = json.loads(out[out.index("{") :])
    pol = {p["policy"].lower(): p for p in doc["policies"]}
    a, f, arc = pol.get("adaptive"), pol.get("fixed"), pol.get("arc")
    rows = []
    if a and arc:
        rows.append(
            Row(
                "simulate",
                f"bundled trace ({doc['trace']['jobs']} jobs): adaptive p95 wait",
                f"{a['p95_wait_seconds']} s",
                f"ARC {arc['p95_wait_seconds']} s",
                _ratio(a["p95_wait_seconds"], arc["p95_wait_seconds"]),
                "<= ARC's",
            )
        )
    if a and f:
        rows.append(
            Row(
                "simulate",
                "bundled trace: adaptive idle runner-minutes",
                f"{a['idle_runner_minutes']}",
                f"fixed minIdle {f['idle_runner_minutes']}",
                _ratio(a["idle_runner_minutes"], f["idle_runner_minutes"]),
                "<= fixed minIdle's",
            )
        )
    return rows


# ---------------------------------------------------------------------- presets


def presets(name: str) -> list[Bench]:
    py = sys.executable
    fleet = str(HERE / "fleet.py")

    def fl(*a: str) -> list[str]:
        return [py, fleet, *a]

    if name == "quick":
        fleets = [
            fl("--pools", "10", "--vms", "20", "--mode", "webhook", "--quiet", "30"),
            fl(
                "--pools",
                "10",
                "--vms",
                "20",
                "--mode",
                "polling",
                "--repos",
                "50",
                "--quiet",
                "30",
            ),
        ]
        hook = ["--samples", "20", "--pools", "1", "20"]
        boot = ["--runs", "3", "--accelerator", "tcg"]
        pickup = ["--jobs", "5", "--mode", "polling", "webhook", "--spread", "5"]
    else:
        fleets = [
            fl("--pools", "10", "--vms", "20", "--mode", "webhook"),
            fl("--pools", "10", "--vms", "20", "--mode", "polling"),
            fl("--pools", "10", "--vms", "20", "--mode", "polling", "--repos", "50"),
            fl("--pools", "10", "--vms", "20", "--mode", "polling", "--repos", "500"),
            fl("--pools", "10", "--vms", "30", "--mode", "webhook", "--agent"),
            fl("--pools", "100", "--vms", "20", "--mode", "webhook"),
        ]
        hook = ["--samples", "40", "--pools", "1", "20", "100"]
        boot = ["--runs", "5", "--accelerator", "tcg"]
        pickup = ["--jobs", "20", "--mode", "polling", "webhook", "hybrid"]
    benches = [
        Bench("webhook_to_vm", [py, str(HERE / "webhook_to_vm.py"), *hook], parse_webhook),
        Bench("qemu_boot", [py, str(HERE / "qemu_boot.py"), *boot], parse_boot),
        Bench("pickup", [py, str(HERE / "pickup.py"), *pickup], parse_pickup),
    ]
    benches += [Bench("fleet", argv, parse_fleet) for argv in fleets]
    benches.append(Bench("simulate", [py, "-m", "impvm.cli", "simulate", "-o", "json"], parse_sim))
    return benches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=["quick", "full"], default="quick")
    ap.add_argument("--only", nargs="*", help="webhook_to_vm, qemu_boot, pickup, fleet, simulate")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark")
    ap.add_argument("--logs", type=Path, default=None, help="directory for each output")
    args = ap.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="impvm-bench-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    failed: list[str] = []
    load0 = os.getloadavg()
    t_all = time.monotonic()
    for i, b in enumerate(presets(args.preset)):
        if args.only and b.name not in args.only:
            continue
        log = logs / f"{i:02d}-{b.name}.log"
        print(f"[run] {' '.join(b.argv[1:])}  (log {log})", flush=True)
        t0 = time.monotonic()
        try:
            # own session, so a timeout ends the benchmark and everything it started
            p = subprocess.Popen(
                b.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
            out_b, _ = p.communicate(timeout=args.timeout)
            out, rc = out_b.decode(errors="replace"), p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 15)
            out_b, _ = p.communicate()
            out, rc = out_b.decode(errors="replace") + "\n[timed out]\n", -1
        log.write_text(out)
        got = b.parse(out, b.argv) if rc == 0 else []
        if rc != 0 or not got:
            failed.append(f"{b.name} (exit {rc}, see {log})")
        rows += got
        print(f"[run] {b.name}: {len(got)} figure(s) in {time.monotonic() - t0:.0f} s", flush=True)
    load1 = os.getloadavg()
    head = ("benchmark", "figure", "value", "baseline (same run)", "ratio", "goal")
    table = [head, *[(r.bench, r.figure, r.value, r.baseline, r.ratio, r.goal) for r in rows]]
    print()
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in head) + " |")
    for t in table[1:]:
        print("| " + " | ".join(t) + " |")
    print(
        f"\n{os.cpu_count()} cores; load average {load0[0]:.1f} at start, {load1[0]:.1f} at end; "
        f"{(time.monotonic() - t_all) / 60:.1f} min; logs in {logs}"
    )
    if failed:
        print("failed: " + "; ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
