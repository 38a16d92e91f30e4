"""Fixtures of the tests on the real multi-node cluster (marker ``cluster``): the cluster itself
(:mod:`impvm.devstack.cluster`, started once per session, only when a test asks for it) and the
four images ``impvm images build`` makes, pushed to the cluster's registry.

The runner layer carries the GitHub stand-in's runner run by the ``impvm`` image's interpreter
(``/opt/impvm/bin/python``), so the tests' VMs boot from the ``impvm`` image plus that layer: the
real runner needs GitHub, and ``runner-base`` has no Python for the stand-in runner.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from impvm.devstack.cluster import Cluster, ClusterConfig
from impvm.images.build import build_images, copy_image
from impvm.images.options import RunnerSource
from tests.images.conftest import build_options

#: the interpreter of the impvm images, which the stand-in runner's run.sh execs in the VM
IMAGE_PYTHON = "/opt/impvm/bin/python"

if os.geteuid() != 0:
    pytest.fail("the cluster tests run kubelets and containerd: run them as root", pytrace=False)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cluster() -> AsyncIterator[Cluster]:
    """A two-node cluster for the session (removed at its end, or by the next start after a
    crash)."""
    async with Cluster(ClusterConfig(name=f"pytest-{os.getpid()}")) as c:
        print(f"cluster: started in {c.started_seconds:.1f}s", flush=True)
        yield c


@dataclass(frozen=True)
class ClusterImages:
    """``registry/impvm/<name>@sha256:...`` of each image in the cluster's registry."""

    operator: str
    agent: str
    runner_base: str
    runner_layer: str

    @property
    def registry(self) -> str:
        return self.operator.split("/", 1)[0]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cluster_images(cluster: Cluster) -> ClusterImages:
    """The four images (built, or taken from the image cache), pushed by digest."""
    built = await build_images(build_options(runner=RunnerSource(standin_python=IMAGE_PYTHON)))
    refs: dict[str, str] = {}
    for image in built:
        repo = f"{cluster.registry}/impvm/{image.name}"
        digest = await copy_image(image, f"docker://{repo}:test", insecure=True)
        refs[image.name] = f"{repo}@{digest}"
    return ClusterImages(
        operator=refs["impvm"],
        agent=refs["impvm-agent"],
        runner_base=refs["runner-base"],
        runner_layer=refs["runner-layer"],
    )
