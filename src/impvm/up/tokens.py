"""The agent's identity under ``impvm up``: two tokens of its ServiceAccount bound to its Node
object (one for the API server, one for the operator's JIT config hand-out) and the kubeconfig
that reads the first."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from impvm.api.models import JIT_HANDOUT_AUDIENCE
from impvm.kube.admin import admin_client, node_bound_token
from impvm.kube.controlplane import ControlPlane, write_private
from impvm.up.manifests import MANAGED_BY, SYSTEM_NAMESPACE


def token_path(data_dir: Path, node: str) -> Path:
    """The file of ``node``'s agent's hand-out token."""
    return data_dir / f"agent-{node}.token"


def api_token_path(data_dir: Path, node: str) -> Path:
    """The file of ``node``'s agent's API server token."""
    return token_path(data_dir, node).with_name(f"agent-{node}-api.token")


def write_agent_kubeconfig(control_plane: ControlPlane, data_dir: Path, node: str) -> Path:
    """Write the kubeconfig of ``node``'s agent: the API server, and the token file of
    :func:`api_token_path` (lightkube's ``tokenFile``, re-read when the API server refuses a
    token)."""
    path = data_dir / f"agent-{node}.kubeconfig"
    cfg = control_plane.token_kubeconfig(api_token_path(data_dir, node))
    write_private(path, yaml.safe_dump(cfg).encode())
    return path


def write_agent_tokens(control_plane: ControlPlane, data_dir: Path, node: str) -> Path:
    """Write the agent's two tokens for ``node``, both of its ServiceAccount and bound to
    the Node object ``node`` (created when missing), so the API server vouches for the node
    (``authentication.kubernetes.io/node-name``), as for a DaemonSet pod's projected
    tokens: one for the API server (its admission policies judge the agent's writes by
    that node) and one with the audience of the operator's JIT config hand-out. Valid a
    day. Returns the hand-out token's file (0600)."""
    admin = admin_client(control_plane.kubeconfig)
    path = token_path(data_dir, node)
    for audience, dest in (
        (None, api_token_path(data_dir, node)),
        (JIT_HANDOUT_AUDIENCE, path),
    ):
        token = node_bound_token(
            admin, SYSTEM_NAMESPACE, "impvm-agent", node, audience, labels=dict(MANAGED_BY)
        )
        tmp = dest.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.replace(tmp, dest)  # the agent never reads half a token
    return path
