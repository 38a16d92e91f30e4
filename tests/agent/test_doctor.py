"""``impvm doctor`` run as a user runs it, on this host and on hosts made to lack things (a
PATH without the tools, a missing kernel): one line per check, a failed one with its fix, exit 1
when a required one failed; and the pure verdict the agent's gate uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from impvm.agent.doctor import Check, lease_value, lines, verdict


def doctor(tmp_path: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "impvm.cli", "doctor", "--workdir", str(tmp_path / "wd"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_verdict_lines_and_lease() -> None:
    checks = [
        Check("skopeo", True, "skopeo version 1.9.3"),
        Check("kvm", False, "/dev/kvm: No such file", "load kvm", required=False),
        Check("umoci", False, "not found on PATH", "apt-get install umoci"),
    ]
    v = verdict(checks)
    assert not v.ok and v.reason == "umoci: not found on PATH (apt-get install umoci)"
    assert lines(checks) == [
        "ok    skopeo: skopeo version 1.9.3",
        "warn  kvm: /dev/kvm: No such file -> load kvm",
        "FAIL  umoci: not found on PATH -> apt-get install umoci",
    ]
    assert verdict(checks[:1]).ok and lease_value(verdict(checks[:1])) == "ok"
    # a warning gates nothing and is shown with the verdict
    assert verdict(checks[:2]).ok
    assert lease_value(verdict(checks[:2])) == "ok; warning: kvm: /dev/kvm: No such file"
    assert lease_value(verdict(checks)) == (
        "failed: umoci: not found on PATH (apt-get install umoci); "
        "warning: kvm: /dev/kvm: No such file"
    )


def test_unisolated_guests_are_a_warning_wherever_the_checks_show(tmp_path: Path) -> None:
    """``--guest-network unisolated`` removes the boundary between guests and this host: the
    doctor says so, and so does the agent's Lease (``impvm status`` shows it) - it never reads
    as a plain "ok"."""
    proc = doctor(tmp_path, "--runtime", "process", "--guest-network", "unisolated", "-o", "json")
    by = {c["name"]: c for c in json.loads(proc.stdout)}
    net = by["guest network"]
    assert (net["ok"], net["required"]) == (False, False)
    assert "unisolated" in net["detail"] and "reach every service" in net["detail"]
    assert "nft" not in by
    checks = [Check(c["name"], c["ok"], c["detail"], c["fix"], c["required"]) for c in by.values()]
    shown = lease_value(verdict(checks))
    assert "ok; warning: guest network: unisolated: VMs share this host's network" in shown
    text = doctor(tmp_path, "--runtime", "process", "--guest-network", "unisolated").stdout
    assert "warn  guest network: unisolated: VMs share this host's network" in text


def test_this_host_can_run_the_process_runtime(tmp_path: Path) -> None:
    proc = doctor(tmp_path, "--runtime", "process", "--guest-network", "isolated")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    names = [ln.split(":")[0].split()[-1] for ln in out[:-1]]
    assert names == ["bwrap", "skopeo", "umoci", "nft", "disk", "namespaces"]
    assert all(ln.startswith("ok ") for ln in out[:-1]) and out[-1].startswith("ready")
    assert "skopeo version" in proc.stdout and "GiB free" in proc.stdout


def test_missing_tools_say_what_to_install(tmp_path: Path) -> None:
    proc = doctor(tmp_path, "--runtime", "process", path="/nonexistent")
    assert proc.returncode == 1
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
    assert "FAIL  bwrap: not found on PATH -> apt-get install bubblewrap" in failed
    assert "FAIL  skopeo: not found on PATH -> apt-get install skopeo" in failed
    assert "FAIL  umoci: not found on PATH -> apt-get install umoci" in failed
    assert proc.stdout.splitlines()[-1] == "not ready"


def test_qemu_without_a_kernel(tmp_path: Path) -> None:
    proc = doctor(
        tmp_path,
        "--runtime",
        "qemu",
        "--qemu-kernel",
        str(tmp_path / "vmlinuz-none"),
        "--no-probe",
        "--guest-network",
        "unisolated",
        "-o",
        "json",
    )
    assert proc.returncode == 1
    by = {c["name"]: c for c in json.loads(proc.stdout)}
    assert by["qemu-system-x86_64"]["ok"]
    assert not by["guest kernel"]["ok"] and "linux-image-amd64" in by["guest kernel"]["fix"]
    assert "nft" not in by  # guests not isolated: nftables not needed
