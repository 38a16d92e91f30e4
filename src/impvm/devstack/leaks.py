"""Searching the embedded stack for leaked secrets (docs/architecture.md, "Where secrets may
be"), shared by the end-to-end tests and the chaos benchmark.

:class:`Recorder` samples the stack while it runs (every JIT config the API server holds, the
stand-in's runner session tokens, VM counts); :func:`haystack` gathers what must never hold a
secret (every log, the agents' token files, VMs, pools, Events, Leases, the operator's metrics);
:func:`leaked` says which secret values occur in it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import httpx
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Secret

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.seed import NAMESPACE
from impvm.devstack.stack import Stack


class Recorder:
    """Samples the stack every 0.2 s while used as a context manager (inside a running event
    loop): VM counts and every secret value seen."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.max_vms = 0
        self.jit_configs: set[str] = set()
        self.session_tokens: set[str] = set()
        self.runner_facts: dict[str, tuple[list[str], int]] = {}
        self.vm_names: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        kube = self.stack.kube
        assert kube is not None
        while True:
            try:
                await self._sample(kube)
            except (ApiError, httpx.HTTPError):  # e.g. 429 while the API server warms up
                pass
            await asyncio.sleep(0.2)

    async def _sample(self, kube: Any) -> None:
        vms = await self.stack.vms()
        self.vm_names |= {v["metadata"]["name"] for v in vms}
        self.max_vms = max(self.max_vms, len(vms))
        async for sec in kube.list(Secret, namespace=NAMESPACE):
            data = sec.data or {}
            if "jitconfig" in data:
                self.jit_configs.add(base64.b64decode(data["jitconfig"]).decode())
        for r in self.stack.runners():
            self.session_tokens.add(r.session_token)
            self.runner_facts[r.name] = (list(r.labels), r.group_id)

    def secrets(self) -> dict[str, str]:
        """Every secret value seen, by value: JIT configs, runner session tokens, installation
        tokens, the App private key's lines and the webhook secret."""
        stack = self.stack
        out = dict.fromkeys(self.jit_configs, "JIT config")
        out |= dict.fromkeys(self.session_tokens, "runner session token")
        if stack.standin is not None:
            out |= dict.fromkeys(stack.standin.state.tokens, "installation token")
        key_lines = [ln for ln in stack.private_key_pem.splitlines() if len(ln) > 40]
        out |= dict.fromkeys(key_lines, "App private key")
        if stack.webhook_secret:
            out[stack.webhook_secret] = "webhook secret"
        return out

    def __enter__(self) -> Recorder:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        if self._task.done():  # the sampler must not have died: its data would be incomplete
            self._task.result()
        self._task.cancel()


async def haystack(stack: Stack, operator_ports: list[int] | None = None) -> dict[str, str]:
    """What must hold no secret, by where it is: every log of the stack, the agents' hand-out
    token files, every ImpVM, pool and Lease, every Event (all namespaces), and the metrics of
    the operator on each of ``operator_ports`` (default: the stack's one) that answers."""
    kube = stack.kube
    assert kube is not None
    out: dict[str, str] = {"logs": stack.logs()}
    for p in stack.config.workdir.glob("*.token"):
        out[p.name] = p.read_text()
    out["ImpVMs"] = "\n".join(repr(v) for v in await stack.vms())
    pools = [o.to_dict() async for o in kube.list(ImpVMRunnerPoolResource, namespace="*")]
    out["pools"] = "\n".join(repr(p) for p in pools)
    out["Leases"] = "\n".join([repr(o.to_dict()) async for o in kube.list(Lease, namespace="*")])
    out["Events"] = "\n".join([repr(e.to_dict()) async for e in kube.list(Event, namespace="*")])
    async with httpx.AsyncClient(timeout=5) as http:
        for port in operator_ports or [stack.operator_http_port]:
            try:
                out[f"metrics :{port}"] = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            except httpx.HTTPError:
                pass
    return out


def leaked(secrets: dict[str, str], texts: dict[str, str]) -> list[tuple[str, str]]:
    """(kind of secret, where) for every secret value of ``secrets`` (value -> kind) found in
    ``texts`` (where -> text), sorted and without repeats."""
    return sorted(
        {
            (kind, where)
            for value, kind in secrets.items()
            for where, t in texts.items()
            if value in t
        }
    )
