"""What the development stack is asked to start (:class:`StackConfig`) and the ``impvm.yaml`` it
generates for ``impvm up`` (:func:`dev_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from impvm.agent.process import host_python_binds
from impvm.devstack.netns import DevNetwork
from impvm.devstack.seed import APP_ID, INSTALLATION_ID, NAMESPACE, POOL, seed_example
from impvm.devstack.testimages import TestImages
from impvm.kube.controlplane import free_port
from impvm.up.config import WEBHOOK_SECRET


def dev_config(
    *,
    workdir: Path,
    standin_url: str,
    key_file: Path,
    registry: str,
    images: TestImages | None,
    operator_port: int,
    agent_metrics_port: int = 0,
    runtime: str = "process",
    agent_vcpu: int = 16,
    agent_memory_mib: int = 32768,
    scaling_mode: str = "polling",
    polling_interval_seconds: int | None = None,
    webhook_secret_file: Path | None = None,
    devnet: DevNetwork | None = None,
    cosign: Path | None = None,
) -> dict[str, Any]:
    """The ``impvm.yaml`` of the development stack (see :mod:`impvm.up.config`): the stand-in
    as GitHub, the loopback registry, the process runtime's host binds, throwaway etcd data, and
    (``images`` given) the minimal example as its class, template and pool, the pool using
    ``scaling_mode`` (the example's polling by default). ``devnet``: VMs on isolated networks
    that reach the stand-in there; without it VMs share the host's network. ``cosign``: the
    agent's cosign binary (None: on PATH)."""
    cfg: dict[str, Any] = {
        "dataDir": str(workdir),
        "github": {
            "apiURL": standin_url,
            "app": {
                "id": APP_ID,
                "installationId": INSTALLATION_ID,
                "privateKeyFile": str(key_file),
            },
        },
        "operator": {"listen": f"127.0.0.1:{operator_port}", "nodeLostGraceSeconds": 5},
        "agent": {
            "runtime": runtime,
            "nodeName": "node-1",
            "vcpu": agent_vcpu,
            "memoryMiB": agent_memory_mib,
            "insecureRegistries": [registry],
            "readOnlyBinds": [str(p) for p in host_python_binds()],
            "metricsListen": f"127.0.0.1:{agent_metrics_port or free_port()}",
            **({"cosign": str(cosign)} if cosign is not None else {}),
        },
        "kubernetes": {"apiPort": 0, "namespace": NAMESPACE, "etcdFsync": False},
    }
    if devnet is not None:
        # no resolver: the stand-in is reached by address
        cfg["agent"].update(
            guestNetwork="isolated",
            guestSubnet=devnet.guest_subnet,
            networkTable=devnet.table,
            networkPrefix=devnet.ifprefix,
            guestDns=["none"],
        )
    else:
        cfg["agent"]["guestNetwork"] = "unisolated"
    if webhook_secret_file is not None:
        cfg["github"]["webhookSecretFile"] = str(webhook_secret_file)
    if images is not None:
        docs = list(yaml.safe_load_all(seed_example(images)))
        objects: dict[str, dict[str, Any]] = {
            "ImpVMClass": {},
            "ImpVMTemplate": {},
            "ImpVMRunnerPool": {},
        }
        for d in docs:
            objects[d["kind"]][d["metadata"]["name"]] = d["spec"]
        pool = objects["ImpVMRunnerPool"][POOL]
        scaling = pool["scaling"]
        if polling_interval_seconds is not None:
            scaling["polling"]["intervalSeconds"] = polling_interval_seconds
        scaling["mode"] = scaling_mode
        if scaling_mode in ("webhook", "hybrid"):
            scaling["webhook"] = {"secretRef": {"name": WEBHOOK_SECRET}}
        if scaling_mode == "webhook":
            del scaling["polling"]
        cfg["classes"] = objects["ImpVMClass"]
        cfg["templates"] = objects["ImpVMTemplate"]
        cfg["pools"] = objects["ImpVMRunnerPool"]
    return cfg


@dataclass
class StackConfig:
    """What to start. ``runtime``: the agent's runtime; sizes in vCPU / MiB."""

    workdir: Path
    runtime: str = "process"
    agent_vcpu: int = 16
    agent_memory_mib: int = 32768
    polling_interval_seconds: int | None = None
    apply_example: bool = True
    #: scaling.mode of the example pool: the example's polling, or webhook/hybrid (the stand-in then
    #: delivers signed workflow_job webhooks to the operator, losing ``webhook_drop_rate``)
    scaling_mode: str = "polling"
    webhook_drop_rate: float = 0.0
    #: start one agent (node-1); without it VMs are created but never run (benchmarks)
    start_agent: bool = True
    #: cosign binary the agent verifies signed images with (None: ``cosign`` on PATH), e.g.
    #: :func:`impvm.signing.cosign.cosign_binary`
    cosign: Path | None = None
    #: guests on isolated networks, the stand-in in its own "internet" namespace
    #: (:class:`impvm.devstack.netns.DevNetwork`; needs root); None: when running as root
    isolated_network: bool | None = None
