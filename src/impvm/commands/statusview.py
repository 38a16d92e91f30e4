"""What ``impvm status`` (and the ``impvm dev up`` live view) shows, from one snapshot of the
cluster: a pure summary (the ``-o json`` document) and its rich rendering.

The summary holds, for a person on call: each pool's counts and conditions with reasons; VMs by
pool, phase and node, and the VMs waiting for a node; each agent's capacity used and offered,
accelerator, heartbeat age and preflight result; the GitHub rate limit per installation
(the newest value any of its pools reported, one row per installation); the newest Warning
Events. A value nobody reported yet renders as ``-``,
never ``None``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from impvm.api.models import POOL_LABEL
from impvm.api.times import parse_time
from impvm.scaling.nodes import NodeLease

#: how many Warning Events the summary keeps (newest first)
MAX_EVENTS = 10
#: VM phases in display order
PHASES = ("Pending", "Scheduled", "Starting", "Running", "Succeeded", "Failed", "Terminating")
#: Lease annotations read besides the capacity ones (:mod:`impvm.scaling.nodes`)
RUNTIME, ACCELERATOR, PREFLIGHT = "imp.dev/runtime", "imp.dev/accelerator", "imp.dev/preflight"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Objects as the API server returns them (dicts), read at ``now`` (timezone-aware)."""

    now: dt.datetime
    pools: Sequence[Mapping[str, Any]] = ()
    vms: Sequence[Mapping[str, Any]] = ()
    leases: Sequence[Mapping[str, Any]] = ()
    events: Sequence[Mapping[str, Any]] = ()
    #: the installation's operator and agent pods (on a cluster; none with ``impvm up``)
    pods: Sequence[Mapping[str, Any]] = ()


def _age(now: dt.datetime, then: dt.datetime | None) -> float | None:
    return None if then is None else round((now - then).total_seconds(), 1)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _pool(raw: Mapping[str, Any]) -> dict[str, Any]:
    meta, st = _meta(raw), raw.get("status") or {}
    spec = raw.get("spec") or {}
    scaling = spec.get("scaling") or {}
    return {
        "namespace": meta.get("namespace"),
        "name": meta.get("name"),
        "mode": scaling.get("mode"),
        "minIdle": scaling.get("minIdle"),
        "maxConcurrent": scaling.get("maxConcurrent"),
        **{
            k: st.get(k)
            for k in ("idle", "busy", "starting", "desired", "pendingJobs", "total", "outdated")
        },
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason", "message")}
            for c in st.get("conditions") or []
        ],
        "credentials": (spec.get("platform") or {}).get("credentialsSecret"),
        "rateLimit": st.get("rateLimit"),
        "timings": st.get("timings") or {},
    }


def _agent(raw: Mapping[str, Any], now: dt.datetime) -> dict[str, Any]:
    meta, spec = _meta(raw), raw.get("spec") or {}
    ann = meta.get("annotations") or {}
    renewed = parse_time(spec.get("renewTime"))
    lease = NodeLease.parse(
        spec.get("holderIdentity") or "", renewed, spec.get("leaseDurationSeconds") or 40, ann
    )
    return {
        "node": lease.node,
        "namespace": meta.get("namespace"),
        "runtime": ann.get(RUNTIME),
        "accelerator": ann.get(ACCELERATOR),
        "vcpu": lease.vcpu,
        "vcpuUsed": lease.vcpu_used,
        "memoryMiB": lease.memory_mib,
        "memoryMiBUsed": lease.memory_mib_used,
        "lastHeartbeat": spec.get("renewTime"),
        "heartbeatAgeSeconds": _age(now, renewed),
        "live": lease.live(now),
        "preflight": ann.get(PREFLIGHT),
    }


def _vm(raw: Mapping[str, Any], now: dt.datetime) -> dict[str, Any]:
    meta, spec, st = _meta(raw), raw.get("spec") or {}, raw.get("status") or {}
    return {
        "namespace": meta.get("namespace"),
        "name": meta.get("name"),
        "pool": (meta.get("labels") or {}).get(POOL_LABEL),
        "node": spec.get("nodeName") or None,
        "phase": st.get("phase"),
        "deleting": bool(meta.get("deletionTimestamp")),
        "ageSeconds": _age(now, parse_time(meta.get("creationTimestamp"))),
        "exitReason": st.get("exitReason"),
        "message": st.get("message"),
        "consoleTail": st.get("consoleTail"),
        "consoleLog": st.get("consoleLog"),
    }


def _pod_problem(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """An operator or agent pod that is not ready, with why: a container's waiting reason
    (``ErrImagePull``, ``ImagePullBackOff``, ``CrashLoopBackOff`` ...) and message, else the
    scheduler's, else its phase. None: every container ready."""
    meta, status = _meta(raw), raw.get("status") or {}
    statuses = status.get("containerStatuses") or []
    if statuses and all(c.get("ready") for c in statuses) and status.get("phase") == "Running":
        return None
    reason, message = status.get("phase") or "Pending", ""
    for c in [*(status.get("initContainerStatuses") or []), *statuses]:
        waiting = (c.get("state") or {}).get("waiting")
        if waiting:
            reason, message = waiting.get("reason") or reason, waiting.get("message") or ""
            break
    else:
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                reason, message = c.get("reason") or reason, c.get("message") or ""
    return {
        "namespace": meta.get("namespace"),
        "pod": meta.get("name"),
        "component": (meta.get("labels") or {}).get("app.kubernetes.io/component"),
        "node": (raw.get("spec") or {}).get("nodeName"),
        "reason": reason,
        "message": str(message)[:600],
    }


def _event(raw: Mapping[str, Any]) -> dict[str, Any]:
    obj = raw.get("involvedObject") or raw.get("regarding") or {}
    when = raw.get("lastTimestamp") or raw.get("eventTime") or _meta(raw).get("creationTimestamp")
    return {
        "time": when,
        "namespace": _meta(raw).get("namespace"),
        "object": f"{obj.get('kind', '')}/{obj.get('name', '')}",
        "reason": raw.get("reason"),
        "message": raw.get("message") or raw.get("note"),
        "count": raw.get("count") or 1,
    }


def _newest(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether rate limit ``a`` was reported after ``b`` (of one installation): a later
    window, or within one window fewer requests left (GitHub only counts down)."""
    ka = (str(a.get("resetAt") or ""), -(a.get("remaining") or 0))
    kb = (str(b.get("resetAt") or ""), -(b.get("remaining") or 0))
    return ka > kb


def _rate_limits(pools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """One row per installation (``rateLimit.installation``; pools that do not say: their
    credentials Secret), its pools, and the newest limit any of them reported: a pool whose
    status is not written often (a manual one) must not show an old value."""
    limits: dict[str, dict[str, Any]] = {}
    for p in pools:
        rl = p["rateLimit"]
        if rl is None or p["credentials"] is None:
            continue
        key = rl.get("installation") or f"{p['namespace']}/{p['credentials']}"
        entry = limits.get(key)
        if entry is None:
            entry = limits[key] = {"installation": key, "pools": []}
        if "limit" not in entry or _newest(rl, entry):
            entry.update({k: v for k, v in rl.items() if k != "installation"})
        entry["pools"].append(p["name"])
    return limits


def summarize(snap: Snapshot) -> dict[str, Any]:
    """The ``-o json`` document (JSON-serializable; see the module docstring). Pure."""
    now = snap.now
    pools = sorted((_pool(p) for p in snap.pools), key=lambda p: (p["namespace"], p["name"]))
    vms = [_vm(v, now) for v in snap.vms]
    by: dict[tuple[str, str, str, str], int] = {}
    for v in vms:
        phase = "Deleting" if v["deleting"] else (v["phase"] or "Unbound")
        k = (v["namespace"] or "", v["pool"] or "-", phase, v["node"] or "-")
        by[k] = by.get(k, 0) + 1
    order = {p: i for i, p in enumerate(("Unbound", *PHASES, "Deleting"))}
    phases = [
        {"namespace": k[0], "pool": k[1], "phase": k[2], "node": k[3], "count": n}
        for k, n in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], order[kv[0][2]]))
    ]
    waiting = [
        v
        for v in sorted(vms, key=lambda v: (v["namespace"], v["name"]))
        if not v["node"] and not v["deleting"] and v["phase"] in (None, "Pending")
    ]
    failed = [v for v in vms if v["phase"] == "Failed"]
    limits = _rate_limits(pools)
    agents = sorted((_agent(le, now) for le in snap.leases), key=lambda a: a["node"])
    warnings = [e for e in snap.events if e.get("type") == "Warning"]
    warnings.sort(key=lambda e: str(_event(e)["time"] or ""), reverse=True)
    return {
        "time": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "pools": pools,
        "vms": {"byPhase": phases, "waitingForNode": waiting, "failed": failed},
        "agents": agents,
        "rateLimits": sorted(limits.values(), key=lambda e: e["installation"]),
        "events": [_event(e) for e in warnings[:MAX_EVENTS]],
        "podsNotReady": sorted(
            (p for p in map(_pod_problem, snap.pods) if p is not None),
            key=lambda p: (str(p["namespace"]), str(p["pod"])),
        ),
    }


# --------------------------------------------------------------------------------------------
# Rendering


def cell(value: Any, unit: str = "") -> str:
    """A table cell: ``-`` for a value not reported yet (never ``None``)."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"
    return f"{value}{unit}"


def _conditions(conds: list[dict[str, Any]]) -> Text:
    """Bad news first: a True problem condition or a False Ready, each with its reason."""
    out = Text()
    for c in conds:
        bad = (c["type"] == "Ready") == (c["status"] != "True")
        if c["type"] == "TemplateMissing" and c["status"] != "True":
            continue
        if not bad and c["type"] != "Ready":
            continue
        if out:
            out.append("; ")
        style = "red" if bad else "green"
        out.append(f"{c['type']}={c['status']}", style=style)
        out.append(f" {c['reason'] or ''}")
        if bad and c.get("message"):
            out.append(f": {c['message']}", style="dim")
    return out if out else Text("-")


def _table(title: str, columns: Sequence[str]) -> Table:
    t = Table(title=title, title_justify="left", expand=True, show_edge=False)
    for col in columns:
        t.add_column(col, overflow="fold")
    return t


def render(summary: Mapping[str, Any]) -> RenderableType:
    """The tables of :func:`summarize`'s document."""
    parts: list[RenderableType] = [Text(f"impvm status at {summary['time']}", style="bold")]
    pools = _table(
        "Pools",
        ("pool", "mode", "idle", "busy", "starting", "desired", "pending", "total", "conditions"),
    )
    for p in summary["pools"]:
        pools.add_row(
            f"{p['namespace']}/{p['name']}",
            cell(p["mode"]),
            *(cell(p[k]) for k in ("idle", "busy", "starting", "desired", "pendingJobs", "total")),
            _conditions(p["conditions"]) if p["conditions"] else Text("waiting for status"),
        )
    if not summary["pools"]:
        pools.add_row("no pools", *["-"] * 8)
    parts.append(pools)

    vms = _table("VMs by phase and node", ("pool", "phase", "node", "count"))
    for row in summary["vms"]["byPhase"]:
        pool = f"{row['namespace']}/{row['pool']}"
        vms.add_row(pool, row["phase"], row["node"], cell(row["count"]))
    if not summary["vms"]["byPhase"]:
        vms.add_row("no VMs", "-", "-", "-")
    parts.append(vms)
    waiting = summary["vms"]["waitingForNode"]
    if waiting:
        w = _table("VMs waiting for a node", ("vm", "pool", "age"))
        for v in waiting:
            w.add_row(f"{v['namespace']}/{v['name']}", cell(v["pool"]), cell(v["ageSeconds"], "s"))
        parts.append(w)
    failed = summary["vms"]["failed"]
    if failed:
        f = _table("Failed VMs", ("vm", "node", "reason", "console (last lines)", "full log"))
        for v in failed:
            tail = v["consoleTail"] or v["message"] or ""
            f.add_row(
                f"{v['namespace']}/{v['name']}",
                cell(v["node"]),
                cell(v["exitReason"]),
                cell("\n".join(tail.splitlines()[-3:])),
                cell(v["consoleLog"] and f"impvm logs -n {v['namespace']} {v['name']}"),
            )
        parts.append(f)

    agents = _table(
        "Agents",
        ("node", "runtime", "accel", "vCPU used/total", "MiB used/total", "heartbeat", "preflight"),
    )
    for a in summary["agents"]:
        beat = cell(a["heartbeatAgeSeconds"], "s ago")
        agents.add_row(
            a["node"],
            cell(a["runtime"]),
            cell(a["accelerator"]),
            f"{cell(a['vcpuUsed'])}/{cell(a['vcpu'])}",
            f"{cell(a['memoryMiBUsed'])}/{cell(a['memoryMiB'])}",
            Text(beat) if a["live"] else Text(f"{beat} (lost)", style="red"),
            cell(a["preflight"]),
        )
    if not summary["agents"]:
        agents.add_row("no agents", *["-"] * 6)
    parts.append(agents)

    if summary.get("podsNotReady"):
        pods = _table("Operator and agent pods not ready", ("pod", "node", "reason", "message"))
        for p in summary["podsNotReady"]:
            pods.add_row(
                f"{p['namespace']}/{p['pod']}",
                cell(p["node"]),
                cell(p["reason"]),
                cell(p["message"]),
            )
        parts.append(pods)

    rl = _table(
        "GitHub rate limit per installation",
        ("credentials", "remaining/limit", "resets", "pools"),
    )
    for e in summary["rateLimits"]:
        rl.add_row(
            e["installation"],
            f"{cell(e.get('remaining'))}/{cell(e.get('limit'))}",
            cell(e.get("resetAt")),
            ", ".join(e["pools"]),
        )
    if not summary["rateLimits"]:
        rl.add_row("not reported yet", "-", "-", "-")
    parts.append(rl)

    tm = _table(
        "Job timings, last hour (p50 / p95)",
        ("pool", "job pickup", "VM boot", "runner registration"),
    )
    for p in summary["pools"]:

        def q(kind: str, t: Mapping[str, Any] = p["timings"]) -> str:
            got = t.get(kind)
            if not got:
                return "-"
            p50, p95 = cell(got.get("p50Seconds"), "s"), cell(got.get("p95Seconds"), "s")
            return f"{p50} / {p95} (n={got.get('count')})"

        tm.add_row(
            f"{p['namespace']}/{p['name']}", q("jobPickup"), q("vmBoot"), q("runnerRegistration")
        )
    if not summary["pools"]:
        tm.add_row("-", "-", "-", "-")
    parts.append(tm)

    ev = _table("Last warning Events", ("time", "object", "reason", "message"))
    for e in summary["events"]:
        count = f" (x{e['count']})" if (e.get("count") or 1) > 1 else ""
        ev.add_row(
            cell(e["time"]),
            f"{e['namespace']}/{e['object']}",
            cell(e["reason"]),
            f"{cell(e['message'])}{count}",
        )
    if not summary["events"]:
        ev.add_row("none", "-", "-", "-")
    parts.append(ev)
    return Group(*parts)
