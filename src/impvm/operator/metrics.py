"""Prometheus metrics of the pool controller (prefix ``impvm_``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from impvm.api.models import PoolKey
from impvm.scaling.jobs import Job, PoolScope, tied
from impvm.scaling.poolpass import Counts

log = logging.getLogger("impvm.operator.routing")

POLL_CALLS = Counter("impvm_poll_api_calls_total", "GitHub requests made by job polling.")
POOL_VMS = Gauge("impvm_pool_vms", "VMs of a pool by state.", ["namespace", "pool", "state"])
POOL_DESIRED = Gauge("impvm_pool_desired_vms", "VMs a pool wants.", ["namespace", "pool"])
POOL_PENDING = Gauge(
    "impvm_pool_pending_jobs", "Queued jobs routed to a pool, no runner yet.", ["namespace", "pool"]
)
VMS_CREATED = Counter("impvm_vms_created_total", "ImpVMs created.", ["namespace", "pool"])
BINDINGS = Counter(
    "impvm_vm_bindings_total", "ImpVMs the operator bound to a node (spec.nodeName).", ["node"]
)
JIT_MINTS = Counter(
    "impvm_jit_mints_total",
    "JIT runner registrations minted, by result (ok, or the GitHub failure reason such as "
    "RateLimited; SecretWriteFailed when the Secret could not be written).",
    ["namespace", "pool", "result"],
)
#: seconds: from a second to half an hour (a job waiting for a slow boot, a full pool)
WAIT_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
JOB_PICKUP = Histogram(
    "impvm_job_pickup_seconds",
    "A job's wait from queued (first seen by impvm) to in progress on one of the pool's runners.",
    ["namespace", "pool"],
    buckets=WAIT_BUCKETS,
)
RUNNER_REGISTRATION = Histogram(
    "impvm_runner_registration_seconds",
    "From an ImpVM's creation to its runner listed online by GitHub.",
    ["namespace", "pool"],
    buckets=WAIT_BUCKETS,
)
VM_LIFETIME = Histogram(
    "impvm_vm_lifetime_seconds",
    "From an ImpVM's creation to the operator deleting it (its one job done, or scaled down).",
    ["namespace", "pool"],
    buckets=(10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
)
OBSERVED = {"jobPickup": JOB_PICKUP, "runnerRegistration": RUNNER_REGISTRATION}
REAPER_DECISIONS = Counter(
    "impvm_reaper_decisions_total",
    "Reaper verdicts by action (delete, keep, not_judged) and the table rule that decided.",
    ["namespace", "pool", "action", "reason"],
)

JOB_ROUTING_TIES = Counter(
    "impvm_job_routing_ties_total",
    "Queued jobs that fitted several pools of their installation equally well; each went to "
    "the oldest of them (by creation time, then uid), never by name.",
)


def note_routing(job: Job, scopes: Sequence[PoolScope]) -> None:
    """Count (and log) a newly queued job that several pools fit equally well."""
    pools = tied(job, scopes)
    if pools:
        JOB_ROUTING_TIES.inc()
        log.info(
            "job %d of %s fits %d pools equally well; routed to the oldest, %s/%s (also: %s)",
            job.id,
            job.repository,
            len(pools),
            pools[0].namespace,
            pools[0].name,
            ", ".join(f"{p.namespace}/{p.name}" for p in pools[1:]),
        )


#: the states ``impvm_pool_vms`` is exported for
STATES = ("starting", "idle", "busy", "terminating", "outdated")


def record_pool(key: PoolKey, counts: Counts, created: int) -> None:
    """Export one pass's counts (``counts`` include the VMs it created)."""
    ns, name = key
    if created:
        VMS_CREATED.labels(ns, name).inc(created)
    for state, n in (
        ("starting", counts.starting),
        ("idle", counts.idle),
        ("busy", counts.busy),
        ("terminating", counts.terminating),
        ("outdated", counts.outdated),
    ):
        POOL_VMS.labels(ns, name, state).set(n)
    POOL_DESIRED.labels(ns, name).set(counts.desired)
    POOL_PENDING.labels(ns, name).set(counts.pending)


def forget_pool(key: PoolKey) -> None:
    """Remove a deleted pool's gauges: a gauge left behind reports a pool that is no more as
    if it still held VMs (Prometheus keeps serving a label set until it is removed). Counters
    and histograms stay (their rates end by themselves)."""
    ns, name = key
    for gauge, labels in (
        *((POOL_VMS, (ns, name, state)) for state in STATES),
        (POOL_DESIRED, (ns, name)),
        (POOL_PENDING, (ns, name)),
    ):
        try:
            gauge.remove(*labels)
        except KeyError:
            pass  # never exported
