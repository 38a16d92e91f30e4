"""The pinned cosign CLI, built once from its Go module by ``assets/build-cosign.sh`` and cached
under ``~/.cache/impvm/cosign/<version>`` (scripts/setup.sh builds it). The agent runs it to
verify signatures (:mod:`impvm.agent.signing`), the image build puts it into the agent image, and
the embedded stack signs its test images with it.

Example::

    cosign_binary(build=False)   # Path('/root/.cache/impvm/cosign/v2.../cosign') or SigningError
"""

from __future__ import annotations

import os
import subprocess
from importlib import resources
from pathlib import Path


class SigningError(Exception):
    """cosign or skopeo failed (the message names the step and carries the tool's stderr)."""


def cosign_binary(build: bool = True) -> Path:
    """Path of the pinned cosign CLI, building it first when the cache lacks it (minutes) unless
    ``build`` is False. Raises :class:`SigningError` when it is missing (``build=False``) or the
    build fails."""
    script = resources.files("impvm.signing").joinpath("assets/build-cosign.sh")
    env = dict(os.environ)
    if not build:
        env["IMPVM_COSIGN_CHECK_ONLY"] = "1"
    proc = subprocess.run(
        ["bash", str(script)], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise SigningError(f"cosign: {proc.stderr.strip()[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])
