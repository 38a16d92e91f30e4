"""What every runner layer holds besides the runner itself: the reference ``/usr/local/bin/runner``
wrapper (``impvm/agent/assets/runner``, the runner image contract of docs/images.md) and, for
tests and development only, a ``run.sh`` that starts the stand-in runner instead of GitHub's.

Example::

    runner_wrapper_script()[:2]      # b'#!'
    standin_run_sh("/usr/bin/python3")
    # '#!/bin/sh\nexec /usr/bin/python3 -m impvm.devstack.standin_runner "$@"\n'
"""

from __future__ import annotations

import shlex
import sys
from importlib import resources


def runner_wrapper_script() -> bytes:
    """The reference ``/usr/local/bin/runner`` wrapper (``impvm/agent/assets/runner``)."""
    return resources.files("impvm.agent").joinpath("assets/runner").read_bytes()


def standin_run_sh(python: str | None = None) -> str:
    """A ``run.sh`` that execs the stand-in runner: ``PYTHON -m impvm.devstack.standin_runner``.

    ``python`` defaults to ``sys.executable`` of the building process; the process runtime must
    expose that interpreter inside the sandbox (``ProcessRuntime(extra_ro_binds=...)``, see
    :func:`impvm.agent.process.host_python_binds`).
    """
    py = shlex.quote(python or sys.executable)
    return f'#!/bin/sh\nexec {py} -m impvm.devstack.standin_runner "$@"\n'
