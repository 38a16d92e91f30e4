"""A local user on an ``impvm up`` host gets nothing from what it opens: no App key, no write.

``impvm up``'s service runs here (its control plane, operator and agent as processes, the
GitHub stand-in as GitHub). The test finds every socket its processes listen on (``ss``), so an
endpoint added later is probed too - or fails the test as one nobody accounted for. Then a user
made for the test (``useradd``), with no capability and no group (``setpriv``), tries each:

* etcd's client and peer URLs: plain HTTP, and HTTPS without a client certificate - reading a
  Secret, writing a key (the way to an RBAC object that would hand out the App key), the
  member list, metrics;
* the API server: every request without credentials, ``/healthz`` and ``/version`` included,
  the App Secret, a ClusterRoleBinding;
* the operator (webhooks, metrics, health, the JIT config hand-out) and the agent's metrics:
  what they serve to anyone (health and metrics) carries no secret, and nothing else answers
  without a signature or a node-bound token;
* the data directory's files (kubeconfigs, keys, tokens).

Then it checks, as root, that no probe wrote anything.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding

from impvm.devstack.devconfig import dev_config
from impvm.devstack.seed import make_private_key, random_webhook_secret, seed_github
from impvm.devstack.standin import StandIn
from impvm.kube.admin import admin_client
from impvm.kube.controlplane import free_port, write_private
from impvm.up.loader import load_config
from impvm.up.service import Service

pytestmark = [pytest.mark.controlplane]

if os.geteuid() != 0:  # making a user and dropping to it needs root (CI runs as root)
    pytest.fail("the local-user probe needs root", pytrace=False)

#: the probe runs as the unprivileged user, with the system's Python (stdlib only)
PROBE = r"""
import base64, http.client, json, ssl, sys

targets, files = json.loads(sys.argv[1]), json.loads(sys.argv[2])
b64 = lambda s: base64.b64encode(s.encode()).decode()
REQUESTS = [
    ("GET", "/", None),
    ("GET", "/version", None),
    ("GET", "/healthz", None),
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("GET", "/members", None),
    ("GET", "/debug/pprof/", None),
    ("POST", "/v3/kv/range", {"key": b64("/registry/secrets/default/github-runner-app")}),
    ("POST", "/v3/kv/range", {"key": b64("/registry/"), "range_end": b64("/registry0")}),
    ("POST", "/v3/kv/put", {"key": b64("/registry/impvm-probe"), "value": b64("written")}),
    ("GET", "/api/v1/namespaces/default/secrets/github-runner-app", None),
    ("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "impvm-probe"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cluster-admin"},
        "subjects": [{"kind": "User", "name": "probe", "apiGroup": "rbac.authorization.k8s.io"}],
    }),
    ("POST", "/webhooks/github", {"action": "queued"}),
    ("GET", "/agents/v1/namespaces/default/impvms/any/jitconfig", None),
]

def call(host, port, tls, method, path, body):
    try:
        if tls:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # the user does not have the CA either way
            c = http.client.HTTPSConnection(host, port, timeout=10, context=ctx)
        else:
            c = http.client.HTTPConnection(host, port, timeout=10)
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return {"status": r.status, "body": r.read(1 << 20).decode(errors="replace")}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}

out = {"endpoints": [], "files": {}}
for t in targets:
    for tls in (False, True):
        for method, path, body in REQUESTS:
            got = call(t["host"], t["port"], tls, method, path, body)
            out["endpoints"].append({**t, "tls": tls, "method": method, "path": path, **got})
for f in files:
    try:
        with open(f, "rb") as fh:
            out["files"][f] = "read " + str(len(fh.read()))
    except OSError as e:
        out["files"][f] = type(e).__name__
print(json.dumps(out))
"""


@dataclass
class Host:
    service: Service
    private_key: str
    webhook_secret: str
    probe_dir: Path


def listening(pids: set[int]) -> list[tuple[str, str, int, int]]:
    """(protocol, address, port, pid) of every socket ``pids`` listen on (``ss``)."""
    out = subprocess.run(
        ["ss", "-H", "-l", "-n", "-t", "-u", "-p"], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        proto, local = cols[0], cols[4]
        addr, _, port = local.rpartition(":")
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((proto, addr.strip("[]"), int(port), pid))
    return found


def tree(pids: list[int]) -> set[int]:
    """``pids`` and all their descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
    seen, todo = set(), list(pids)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo += children.get(p, [])
    return seen


@pytest.fixture
def local_user() -> Iterator[tuple[int, int]]:
    """A user of this machine with no privilege (uid, gid), removed afterwards."""
    name = f"ivprobe{uuid.uuid4().hex[:6]}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        out = subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True)
        uid = int(out.stdout)
        gid = int(subprocess.run(["id", "-g", name], capture_output=True, text=True).stdout)
        yield uid, gid
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def _prepare(standin_url: str, pem: str) -> tuple[Path, str]:
    """The App's files and ``impvm.yaml`` (a development configuration: the stand-in as GitHub)
    in a directory of their own; returns it and the webhook secret."""
    probe_dir = Path(tempfile.mkdtemp(prefix="impvm-probe-"))
    probe_dir.chmod(0o755)
    etc = probe_dir / "etc"
    etc.mkdir(mode=0o700)
    key_file, hook_file = etc / "app.pem", etc / "webhook-secret"
    write_private(key_file, pem.encode())
    hook = random_webhook_secret()
    write_private(hook_file, hook.encode())
    cfg = dev_config(
        workdir=probe_dir / "data",
        standin_url=standin_url,
        key_file=key_file,
        registry="127.0.0.1:5000",
        images=None,
        operator_port=free_port(),
        webhook_secret_file=hook_file,
    )
    (probe_dir / "impvm.yaml").write_text(yaml.safe_dump(cfg))
    return probe_dir, hook


@pytest.fixture
async def host() -> AsyncIterator[Host]:
    """``impvm up``'s service with a data directory a local user can reach the door of (its
    parent is world-traversable, as /var/lib is): the directory's own modes are what count."""
    standin = StandIn()
    await standin.start()
    pem = make_private_key()
    seed_github(standin, pem)
    probe_dir, hook = await asyncio.to_thread(_prepare, standin.url, pem)
    service = Service(load_config(probe_dir / "impvm.yaml"))
    try:
        await service.start()
        yield Host(service, pem, hook, probe_dir)
    finally:
        await service.stop()
        await standin.stop()
        shutil.rmtree(probe_dir, ignore_errors=True)


def probe(host: Host, user: tuple[int, int], targets: list[dict[str, Any]],
          files: list[str]) -> dict[str, Any]:  # fmt: skip
    script = host.probe_dir / "probe.py"
    script.write_text(PROBE)
    script.chmod(0o644)
    uid, gid = user
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
         "--bounding-set=-all", "--", "/usr/bin/python3", str(script), json.dumps(targets),
         json.dumps(files)],
        capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"},
        cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got: dict[str, Any] = json.loads(proc.stdout)
    return got


async def test_a_local_user_gets_no_secret_and_no_write_from_any_endpoint(
    host: Host, local_user: tuple[int, int]
) -> None:
    await asyncio.to_thread(_attack, host, local_user)


def _attack(host: Host, local_user: tuple[int, int]) -> None:
    svc = host.service
    cp = svc.control_plane
    assert cp is not None
    ports = json.loads((cp.workdir / "ports.json").read_text())
    operator_port = svc.operator_port
    agent_port = int(svc.config.agent.metrics_listen.rpartition(":")[2])
    kinds = {
        cp.api_port: "kube-apiserver",
        ports["etcd"]: "etcd client",
        ports["peer"]: "etcd peer",
        operator_port: "operator",
        agent_port: "agent metrics",
    }
    pids = tree([*(p.pid for p in cp.procs.values()), *(p.pid for p in svc.procs.values())])
    for _ in range(600):  # the operator and the agent come up after the control plane
        found = listening(pids)
        if {f[2] for f in found} >= set(kinds):
            break
        time.sleep(0.2)
    unknown = [f for f in found if f[2] not in kinds]
    assert unknown == [], f"listening, and not accounted for: {unknown}"
    assert {f[2] for f in found} == set(kinds), found  # every one of them is up
    assert all(f[0] == "tcp" for f in found), found
    targets = [
        {"kind": kinds[port], "host": "127.0.0.1" if addr in ("0.0.0.0", "*") else addr, "port": port}
        for port, addr in sorted({(f[2], f[1]) for f in found})
    ]  # fmt: skip
    data = svc.data_dir
    files = [
        str(p) for p in (
            data / "controlplane" / "kubeconfig", data / "controlplane" / "pki" / "ca.key",
            data / "controlplane" / "pki" / "etcd-ca.key",
            data / "controlplane" / "pki" / "apiserver-etcd-client.key",
            data / "operator.kubeconfig", data / "agent-node-1.kubeconfig",
            data / "agent-node-1-api.token", data / "agent-node-1.token",
            data / "controlplane" / "etcd" / "member" / "snap" / "db",
        )
    ]  # fmt: skip
    got = probe(host, local_user, targets, files)

    # no file of the data directory opens for that user
    assert got["files"] == {f: "PermissionError" for f in files}, got["files"]
    key_lines = [ln for ln in host.private_key.splitlines() if len(ln) > 40]
    answered: dict[str, set[int]] = {}
    for r in got["endpoints"]:
        text = r.get("body", "") + r.get("error", "")
        assert not any(ln in text for ln in key_lines), r  # never a piece of the App key
        assert host.webhook_secret not in text, r
        if "status" in r:
            answered.setdefault(r["kind"], set()).add(r["status"])
        ok = "status" in r and r["status"] < 300
        where = f"{r['kind']} {'https' if r['tls'] else 'http'} {r['method']} {r['path']}"
        if r["kind"] in ("etcd client", "etcd peer", "kube-apiserver"):
            assert not ok, f"{where} answered {r['status']}: {r.get('body', '')[:300]}"
        else:  # the operator and the agent answer health and metrics to anyone, nothing else
            public = r["method"] == "GET" and r["path"] in ("/healthz", "/metrics")
            assert ok == (public and not r["tls"]), f"{where}: {r}"
    # etcd refuses a client without a certificate at the TLS handshake; plain HTTP gets 400
    for kind in ("etcd client", "etcd peer"):
        tls = [r for r in got["endpoints"] if r["kind"] == kind and r["tls"]]
        assert tls and all("error" in r for r in tls), tls[:2]
        assert answered.get(kind, set()) <= {400}, answered
    # the API server: 401 for everything without credentials, /healthz and /version included
    api = [r for r in got["endpoints"] if r["kind"] == "kube-apiserver" and r["tls"]]
    assert {r["status"] for r in api} == {401}, {(r["path"], r.get("status")) for r in api}

    # and nothing was written
    kube = admin_client(cp.kubeconfig)
    with pytest.raises(Exception, match="not found"):
        kube.get(ClusterRoleBinding, "impvm-probe")
    import urllib.request

    body = json.dumps({"key": base64.b64encode(b"/registry/impvm-probe").decode()}).encode()
    req = urllib.request.Request(f"{cp.etcd_url}/v3/kv/range", data=body)
    with urllib.request.urlopen(req, timeout=10, context=cp.etcd_tls()) as resp:
        assert not json.loads(resp.read()).get("kvs")
