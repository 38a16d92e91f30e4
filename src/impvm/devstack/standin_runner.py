"""Stand-in runner: the program a test runner layer ships as ``run.sh``.

Reads the JIT config from ``ACTIONS_RUNNER_INPUT_JITCONFIG`` (as the real runner does), decodes
it (base64 JSON with base64 JSON ``.runner`` and ``.credentials`` entries, like GitHub's), goes
online with the stand-in named in ``.runner.serverUrl``, takes at most one job whose labels it
satisfies, runs it (``command`` as an argv list, else sleeps ``sleep_seconds``), reports the
conclusion and exits 0. Exits 2 on a malformed config, 3 when no job arrived within
``IMPVM_STANDIN_RUNNER_IDLE_TIMEOUT`` seconds (unset or 0: wait forever), 1 on HTTP failure.
The JIT config and the session token are never printed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

JIT_ENV = "ACTIONS_RUNNER_INPUT_JITCONFIG"
IDLE_ENV = "IMPVM_STANDIN_RUNNER_IDLE_TIMEOUT"


def decode_jitconfig(encoded: str) -> tuple[dict[str, Any], str]:
    """``(runner settings, session token)`` from an encoded JIT config; ``ValueError`` if
    malformed (the message never contains the config)."""
    try:
        outer = json.loads(base64.b64decode(encoded))
        runner = json.loads(base64.b64decode(outer[".runner"]))
        credentials = json.loads(base64.b64decode(outer[".credentials"]))
        token = str(credentials["data"]["token"])
        str(runner["serverUrl"])
    except (ValueError, KeyError, TypeError):
        raise ValueError("malformed JIT config") from None
    return runner, token


def _heartbeat(base: str, headers: dict[str, str], done: threading.Event) -> None:
    """Tell the server every 5 s that the runner is alive while a job runs (GitHub fails the
    job of a runner that goes silent)."""
    with httpx.Client(headers=headers, timeout=10.0) as http:
        while not done.wait(5.0):
            with contextlib.suppress(httpx.HTTPError):
                http.post(f"{base}/heartbeat")


def run(encoded: str, idle_timeout: float = 0.0) -> int:
    """Register, take at most one job, run it, report, deregister. Returns the exit code."""
    try:
        settings, token = decode_jitconfig(encoded)
    except ValueError as exc:
        print(f"standin-runner: {exc}", file=sys.stderr)
        return 2
    base = str(settings["serverUrl"]).rstrip("/")
    name = settings.get("agentName", "?")
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(headers=headers, timeout=60.0) as http:
        try:
            http.post(f"{base}/session").raise_for_status()
            print(f"standin-runner: {name} online", flush=True)
            deadline = time.monotonic() + idle_timeout if idle_timeout > 0 else None
            job: dict[str, Any] | None = None
            while job is None:
                wait = 20.0
                if deadline is not None:
                    wait = max(min(wait, deadline - time.monotonic()), 0.0)
                resp = http.post(f"{base}/acquire", json={"wait": wait})
                resp.raise_for_status()
                if resp.status_code == 200:
                    job = resp.json()["job"]
                elif deadline is not None and time.monotonic() >= deadline:
                    print(f"standin-runner: {name} got no job", flush=True)
                    http.delete(f"{base}/session")
                    return 3
            print(f"standin-runner: {name} running job {job['id']}", flush=True)
            conclusion = "success"
            done = threading.Event()
            beat = threading.Thread(target=_heartbeat, args=(base, headers, done), daemon=True)
            beat.start()
            try:
                if job.get("command"):
                    # job steps never see the runner's credentials (the JIT config)
                    env = {k: v for k, v in os.environ.items() if k != JIT_ENV}
                    argv = [str(a) for a in job["command"]]
                    rc = subprocess.run(argv, check=False, env=env).returncode
                    conclusion = "success" if rc == 0 else "failure"
                else:
                    time.sleep(float(job.get("sleep_seconds") or 0))
            finally:
                done.set()
                # a daemon thread still inside httpx when the interpreter shuts down can crash
                # it (exit 139 seen in slow VMs): let the last heartbeat finish first
                beat.join(timeout=15.0)
            http.post(
                f"{base}/jobs/{job['id']}/complete", json={"conclusion": conclusion}
            ).raise_for_status()
            http.delete(f"{base}/session")
            print(f"standin-runner: {name} job {job['id']} {conclusion}", flush=True)
        except httpx.HTTPError as exc:
            print(f"standin-runner: {name} HTTP failure: {type(exc).__name__}", file=sys.stderr)
            return 1
    return 0


def main() -> int:
    """Entry point: read the JIT config from the environment and :func:`run`."""
    encoded = os.environ.get(JIT_ENV, "")
    if not encoded:
        print(f"standin-runner: {JIT_ENV} is not set", file=sys.stderr)
        return 2
    return run(encoded, float(os.environ.get(IDLE_ENV, "0") or 0))


if __name__ == "__main__":
    sys.exit(main())
