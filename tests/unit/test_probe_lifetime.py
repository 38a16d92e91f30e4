"""An accelerator probe never outlives the agent that started it (VMs do; probes must not: a
killed ``impvm up`` left a probe QEMU spinning at full CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def test_probe_dies_with_a_killed_agent(tmp_path: Path) -> None:
    marker = f"sleep 60.{os.getpid()}"  # a command line no other process has
    fake_qemu = tmp_path / "qemu"  # ignores its arguments and never prints the probe marker
    fake_qemu.write_text(f"#!/bin/sh\nexec {marker}\n")
    fake_qemu.chmod(0o755)
    script = textwrap.dedent(
        f"""
        import asyncio
        from pathlib import Path
        from impvm.agent.qemu_accel import probe_boot
        asyncio.run(probe_boot({str(fake_qemu)!r}, "tcg", "microvm", Path("k"), Path("i"), 60))
        """
    )
    agent = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(100):  # the probe started
            if subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the probe never started")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        for _ in range(50):
            if subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0:
                return
            time.sleep(0.1)
        raise AssertionError("the probe outlived its agent")
    finally:
        subprocess.run(["pkill", "-f", marker], check=False)
        if agent.poll() is None:
            agent.kill()
