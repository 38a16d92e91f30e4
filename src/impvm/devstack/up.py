"""``impvm dev up``: the embedded local stack.

Starts a real control plane (etcd + kube-apiserver + garbage collector), installs the imp.dev CRDs
and prints how to reach it; then waits until interrupted. The operator, agent, GitHub stand-in and
the seed's example arrive with the pool-controller issue.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
from pathlib import Path

from impvm.devstack.controlplane import ControlPlane, ControlPlaneError
from impvm.devstack.kube import admin_client, install_crds


def run(runtime: str, jobs: int, until_done: bool, workdir: str | None) -> int:
    """Run the embedded stack; return the process exit code.

    ``jobs``/``until_done``/``runtime`` other than the defaults need the operator and agent, which
    are not available yet: exit 2 with a clear message rather than pretend.
    """
    if jobs or until_done or runtime != "process":
        print(
            "impvm dev up: --jobs/--until-done/--runtime need the operator and agent, "
            "not available yet (pool-controller issue).",
            file=sys.stderr,
        )
        return 2
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="impvm-dev-"))
    cp = ControlPlane(workdir=base / "controlplane")
    try:
        cp.start()
        install_crds(admin_client(cp.kubeconfig))
    except (ControlPlaneError, TimeoutError) as e:
        cp.stop()
        print(f"impvm dev up: {e}", file=sys.stderr)
        return 1
    print(
        f"control plane ready at {cp.url} with the imp.dev CRDs installed\n"
        f"  export KUBECONFIG={cp.kubeconfig}\n"
        f"  {cp.kubectl} get crds\n"
        f"  {cp.kubectl} apply -f tests/data/seed-minimal-example.yaml\n"
        "press Ctrl-C to stop",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        cp.stop()
    return 0
