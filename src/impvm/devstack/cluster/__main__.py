"""``python -m impvm.devstack.cluster up|down|serve [--name N] [--nodes K]``: start a test
cluster in the background and print its ``KUBECONFIG`` (up), stop it and remove everything it
made (down), or run one in the foreground until SIGTERM or Ctrl-C (serve; what ``up`` starts).
``scripts/cluster.sh`` runs this. Exit 1 with the reason when the cluster does not start."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from impvm.devstack.cluster import state
from impvm.devstack.cluster.cluster import Cluster, ClusterConfig, ClusterError

READY = "ready.json"


async def serve(config: ClusterConfig) -> int:
    """Start the cluster, write ``ready.json`` (kubeconfig, registry, internet namespace) to
    its workdir, run until SIGTERM/SIGINT, then stop it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cluster = Cluster(config)
    try:
        await cluster.start()
        net = cluster.network
        assert net is not None
        info = {
            "kubeconfig": str(cluster.kubeconfig),
            "kubectl": str(cluster.kubectl_path),
            "registry": cluster.registry,
            "ca": str(cluster.ca),
            "internet_netns": net.internet_ns,
            "internet_address": net.internet_address,
            "nodes": {n.name: n.address.netns for n in cluster.nodes},
            "started_seconds": round(cluster.started_seconds, 1),
        }
        (cluster.workdir / READY).write_text(json.dumps(info, indent=2))
        print(json.dumps(info), flush=True)
        while not stop.is_set():
            cluster.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 2.0)
        return 0
    except ClusterError as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 1
    finally:
        await cluster.stop()


def up(config: ClusterConfig, timeout: float) -> int:
    """Start ``serve`` detached and wait for its ``ready.json``; print ``KUBECONFIG=...``."""
    ready = config.base / config.name / READY
    log = config.base / f"{config.name}.log"
    config.base.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        ready.unlink()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "impvm.devstack.cluster", "serve", *_args(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            print(f"cluster did not start (log {log}):\n{tail}", file=sys.stderr)
            if proc.poll() is None:
                proc.terminate()
            return 1
        time.sleep(0.5)
    info = json.loads(ready.read_text())
    print(f"KUBECONFIG={info['kubeconfig']}")
    print(f"KUBECTL={info['kubectl']}")
    print(f"REGISTRY={info['registry']}")
    print(f"REGISTRY_CA={info['ca']}")
    print(f"INTERNET_NETNS={info['internet_netns']}")
    print(f"# started in {info['started_seconds']}s; stop with: scripts/cluster.sh down")
    return 0


def down(config: ClusterConfig, timeout: float = 120.0) -> int:
    """Stop the named cluster's owner (SIGTERM) and remove whatever is left."""
    record = state.ClusterRecord.load(config.base / config.name / state.RECORD)
    if record is None:
        print(f"no cluster {config.name!r} under {config.base}", file=sys.stderr)
        return 0
    state.stop_owner(record, timeout)
    state.remove(record, keep=state.CACHES)
    return 0


def _args(config: ClusterConfig) -> list[str]:
    return ["--name", config.name, "--nodes", str(config.nodes), "--base", str(config.base)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m impvm.devstack.cluster")
    parser.add_argument("command", choices=("up", "down", "serve"))
    parser.add_argument("--name", default="default")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--base", type=Path, default=state.DEFAULT_BASE)
    parser.add_argument("--timeout", type=float, default=600.0)
    a = parser.parse_args(argv)
    config = ClusterConfig(name=a.name, nodes=a.nodes, base=a.base)
    if a.command == "serve":
        return asyncio.run(serve(config))
    if a.command == "up":
        return up(config, a.timeout)
    return down(config)


if __name__ == "__main__":
    sys.exit(main())
