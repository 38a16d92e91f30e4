"""Shared fixtures: a real control plane (etcd + kube-apiserver + GC) per test session."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from lightkube import AsyncClient, Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace

from impvm.kube.admin import admin_client, install_crds
from impvm.kube.controlplane import ControlPlane

REPO = Path(__file__).resolve().parent.parent

#: registry, test images, image store and the qemu runtime, shared by every runtime test
pytest_plugins = ["tests.runtime_fixtures"]

# Hypothesis' per-example deadline is a timed assert: on a loaded 2-core machine it fails tests
# whose logic is fine. Speed is measured in benchmarks/, never here.
settings.register_profile("impvm", deadline=None)
settings.load_profile("impvm")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A fresh control plane with the imp.dev CRDs installed, shared by the whole session."""
    cp = ControlPlane(workdir=tmp_path_factory.mktemp("controlplane")).start()
    try:
        install_crds(admin_client(cp.kubeconfig))
        os.environ["IMPVM_TEST_KUBECONFIG"] = str(cp.kubeconfig)
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane) -> Client:
    """Admin client (system:masters) of the test control plane."""
    return admin_client(control_plane.kubeconfig)


@pytest.fixture
async def akube(control_plane: ControlPlane) -> AsyncIterator[AsyncClient]:
    """Async admin client of the test control plane."""
    client = AsyncClient(
        config=KubeConfig.from_file(str(control_plane.kubeconfig)), field_manager="impvm-test"
    )
    yield client
    await client.close()


@pytest.fixture
def namespace(kube: Client) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    kube.delete(Namespace, name)
