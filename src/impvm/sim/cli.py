"""``impvm simulate``: replay a job trace through each scaling policy and compare them.

``impvm simulate [TRACE]`` (the same as ``impvm simulate run [TRACE]``) replays TRACE (default:
the bundled bursty day) and prints a table (``-o json``: JSON) with, per policy, the p50, p95
and maximum wait, idle runner-minutes, VM-minutes and peak VMs; ``--plot out.png`` draws wait
and cost over time. ``impvm simulate generate`` writes a bursty trace. A bad trace, option or
``--warm-pool`` file gets one line on stderr naming the row or field, and exit status 2.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

__all__ = ["BUNDLED_TRACE", "simulate_app"]

#: The bundled trace (a bursty working day): ``impvm simulate generate --seed 1``.
BUNDLED_TRACE = "bursty-day.csv"
BUNDLED_SEED = 1

POLICIES = ("fixed", "adaptive", "arc", "garm", "imp")


class _DefaultRun(TyperGroup):
    """``impvm simulate ARGS`` runs ``impvm simulate run ARGS`` unless ARGS name a subcommand
    (or ask for help)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # click's Context
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


simulate_app = typer.Typer(
    cls=_DefaultRun,
    help="Replay a job trace through each scaling policy (run is the default command).",
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Output(StrEnum):
    table = "table"
    json = "json"


class TraceFormat(StrEnum):
    csv = "csv"
    json = "json"


def _fail(message: str) -> typer.Exit:
    typer.echo(f"impvm simulate: {message}", err=True)
    return typer.Exit(code=2)


def _bundled_path() -> Path:
    return Path(str(resources.files("impvm.sim").joinpath("traces", BUNDLED_TRACE)))


def _warm_pool_file(path: Path) -> Any:
    """Read ``--warm-pool FILE``: YAML of a ``scaling.warmPool`` object."""
    import yaml
    from pydantic import ValidationError

    from impvm.api.models import WarmPoolSpec

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(f"{path}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        raise _fail(f"{path}: not YAML: {str(e).splitlines()[0]}") from None
    try:
        return WarmPoolSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err["loc"]) or "warmPool"
        raise _fail(f"{path}: warmPool.{loc}: {err['msg']}") from None


@simulate_app.command("run")
def run(
    trace: Annotated[
        Path | None,
        typer.Argument(help="Trace file (CSV or .json); default: the bundled bursty day."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy", "-p", help=f"Policies to run (default all: {', '.join(POLICIES)})."
        ),
    ] = None,
    output: Annotated[Output, typer.Option("--output", "-o", help="table or json.")] = (
        Output.table
    ),
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of wait and cost over time.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the boot and assignment draws.")] = 1,
    boot_median: Annotated[
        float, typer.Option(help="VM created to runner online: median (s).")
    ] = 15.0,
    boot_p95: Annotated[float, typer.Option(help="VM created to runner online: p95 (s).")] = 40.0,
    assign_median: Annotated[
        float, typer.Option(help="GitHub's assignment delay: median (s).")
    ] = 2.0,
    assign_p95: Annotated[float, typer.Option(help="GitHub's assignment delay: p95 (s).")] = 6.0,
    reaction: Annotated[float, typer.Option(help="Event to controller pass (s).")] = 0.25,
    labels: Annotated[
        list[str] | None, typer.Option("--label", help="Pool labels (default: imp).")
    ] = None,
    min_idle: Annotated[
        int, typer.Option(help="fixed minIdle; ARC minRunners; GARM min idle; Imp minIdle.")
    ] = 4,
    adaptive_min_idle: Annotated[int, typer.Option(help="adaptive: minIdle (its floor).")] = 0,
    max_idle: Annotated[int, typer.Option(help="adaptive: maxIdle.")] = 20,
    safety_percent: Annotated[
        int | None, typer.Option(help="adaptive: safetyPercent (default: the API's).")
    ] = None,
    arrival_half_life: Annotated[
        int | None, typer.Option(help="adaptive: arrivalHalfLifeSeconds (default: the API's).")
    ] = None,
    ready_half_life: Annotated[
        int | None, typer.Option(help="adaptive: readyHalfLifeSamples (default: the API's).")
    ] = None,
    warm_pool: Annotated[
        Path | None,
        typer.Option(
            "--warm-pool",
            help="YAML of a scaling.warmPool for the adaptive policy (overrides the adaptive "
            "options; its minIdle is --adaptive-min-idle).",
        ),
    ] = None,
    max_concurrent: Annotated[int, typer.Option(help="maxConcurrent / maxRunners.")] = 300,
    scale_up_step: Annotated[int, typer.Option(help="scaleUpStep (fixed, adaptive, Imp).")] = 50,
    cooldown: Annotated[int, typer.Option(help="cooldownSeconds (fixed, adaptive).")] = 60,
    bin_minutes: Annotated[float, typer.Option(help="Time bin of the plot (minutes).")] = 10.0,
) -> None:
    """Replay a job trace through each policy: p50/p95 wait, idle runner-minutes, peak VMs."""
    from rich.console import Console
    from rich.markup import escape

    from impvm.sim import compare as runner
    from impvm.sim.trace import TraceError, load_trace

    chosen = policy or list(POLICIES)
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        raise _fail(f"--policy: unknown {', '.join(unknown)} (choose from {', '.join(POLICIES)})")
    path = trace or _bundled_path()
    try:
        jobs = load_trace(path)
    except TraceError as e:
        raise _fail(str(e)) from None
    wp = _warm_pool_file(warm_pool) if warm_pool is not None else None
    try:
        setup = runner.Setup.build(
            seed=seed,
            boot=(boot_median, boot_p95),
            assign=(assign_median, assign_p95),
            reaction=reaction,
            labels=tuple(labels or ("imp",)),
            min_idle=min_idle,
            adaptive_min_idle=adaptive_min_idle,
            max_idle=max_idle,
            safety_percent=safety_percent,
            arrival_half_life=arrival_half_life,
            ready_half_life=ready_half_life,
            warm_pool=wp,
            max_concurrent=max_concurrent,
            scale_up_step=scale_up_step,
            cooldown=cooldown,
            bin_seconds=bin_minutes * 60.0,
        )
    except ValueError as e:
        raise _fail(str(e)) from None
    results = runner.run_all(jobs, setup, chosen)
    name = path.name if trace is not None else f"bundled {BUNDLED_TRACE}"
    title = f"impvm simulate: {name}, {len(jobs)} jobs, seed {seed}"
    summaries = [runner.summarise(r) for r in results]
    if output is Output.json:
        doc = runner.document(path, jobs, setup, summaries)
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        console = Console(width=max(Console().width, 130))
        console.print(runner.table(summaries, escape(title)))
        console.print(escape(runner.describe(setup)))
    if plot is not None:
        try:
            runner.plot(results, runner.arrivals(jobs, setup), plot, title)
        except ImportError:
            raise _fail("--plot needs matplotlib: pip install 'impvm[sim]'") from None
        except OSError as e:
            raise _fail(f"--plot {plot}: {e}") from None


@simulate_app.command("generate")
def generate_cmd(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="File to write (default: stdout).")
    ] = None,
    fmt: Annotated[
        TraceFormat | None,
        typer.Option("--format", help="csv or json (default: from the file name, else csv)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same trace.")] = 1,
    days: Annotated[int, typer.Option(help="Days to generate.")] = 1,
    start: Annotated[
        str, typer.Option(help="Midnight of the first day (ISO 8601 with a time zone).")
    ] = "2026-03-02T00:00:00Z",
    peak_per_minute: Annotated[float, typer.Option(help="Daytime jobs per minute.")] = 8.0,
    night_per_hour: Annotated[float, typer.Option(help="Night-time jobs per hour.")] = 3.0,
    burst_size: Annotated[int, typer.Option(help="Jobs in the afternoon burst.")] = 200,
    burst_at: Annotated[float, typer.Option(help="Hour of day the burst starts.")] = 14.5,
    burst_seconds: Annotated[float, typer.Option(help="Seconds the burst spans.")] = 60.0,
    duration_median: Annotated[float, typer.Option(help="Job duration median (s).")] = 240.0,
    duration_p95: Annotated[float, typer.Option(help="Job duration p95 (s).")] = 1200.0,
    labels: Annotated[
        list[str] | None, typer.Option("--label", help="Job labels (default: self-hosted imp).")
    ] = None,
) -> None:
    """Write a bursty trace: quiet night, morning ramp, busy day, a burst, evening decline."""
    from datetime import datetime

    from impvm.sim.trace import DayProfile, dump_trace, generate

    try:
        t0 = datetime.fromisoformat(start)
        profile = DayProfile(
            start=t0,
            days=days,
            peak_per_minute=peak_per_minute,
            night_per_hour=night_per_hour,
            burst_size=burst_size,
            burst_at=burst_at,
            burst_seconds=burst_seconds,
            duration_median_seconds=duration_median,
            duration_p95_seconds=duration_p95,
            labels=tuple(labels or ("self-hosted", "imp")),
        )
    except ValueError as e:
        raise _fail(str(e)) from None
    kind = fmt.value if fmt else ("json" if output and output.suffix == ".json" else "csv")
    text = dump_trace(generate(profile, seed), kind)
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        raise _fail(f"{output}: {e}") from None
