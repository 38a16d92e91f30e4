"""A guest's console reaches a person without its terminal control sequences: through a real
agent and API server, a runner that prints escape sequences (clear screen, window title,
clipboard write, a hyperlink, 8-bit CSI, carriage returns and backspaces that hide text) fails;
its VM's status and ``impvm logs`` show its text, lines and tabs, and none of the controls."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, Client

from impvm.agent.guesttext import printable
from impvm.api.resources import ImpVMClassResource
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.testimages import build_runner_layer_image
from impvm.kube.controlplane import ControlPlane
from tests.agent.test_agent import Env, until
from tests.runtime_fixtures import Images

pytestmark = [pytest.mark.controlplane]

# printf in busybox sh: \033 ESC, \007 BEL, \302\233 U+009B (8-bit CSI, UTF-8), \r, \b
ESCAPES_RUN_SH = r"""#!/bin/sh
printf 'before\033[2J\033[Hcleared\n'
printf '\033]0;owned-title\007title\n'
printf '\033]52;c;ZWNobyBvd25lZA==\007clipboard\n'
printf '\033]8;;https://attacker.example/\033\\link\033]8;;\033\\\n'
printf '\302\2331;31mred\n'
printf 'rm -rf /\rok      \n'
printf 'secret\b\b\b\b\b\bcovert\n'
printf 'tab\there\n'
printf '\033Pdcs payload\033\\dcs-done\n'
exit 9
"""

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def test_printable_removes_every_control_but_newlines_and_tabs() -> None:
    raw = b"a\x1b[31mred\x1b[0m\tb\r\nc\x1b]0;t\x07d\x9be\xc2\x9b1mf\x07g\x1b(Bh\x1bPq\x1b\\i\n\x00"
    assert printable(raw) == "ared\tb\ncd\ufffdefghi\n"
    assert printable("x\x1b]52;c;AAAA") == "x"  # unterminated: to the end
    assert not CONTROL.search(printable(bytes(range(256))))


async def test_a_failed_vm_s_console_is_shown_without_its_control_sequences(
    kube: Client,
    akube: AsyncClient,
    namespace: str,
    tmp_path: Path,
    images: Images,
    registry: LocalRegistry,
    control_plane: ControlPlane,
) -> None:
    env = Env(kube, akube, namespace, tmp_path, images)
    env.create_class()
    try:
        layer = await build_runner_layer_image(
            tmp_path / "layer", registry.address, run_sh=ESCAPES_RUN_SH, tag="escapes"
        )
        async with env.agent():
            env.create_vm("escapes", layer)

            async def failed() -> dict[str, Any] | None:
                vm = (await env.vms()).get("escapes")
                st = (vm or {}).get("status") or {}
                done = st.get("phase") == "Failed" and st.get("consoleLog")
                return vm if done and not vm["metadata"].get("finalizers") else None

            await until("the VM failed and was released", failed, 120)
            vm = await failed()
        assert vm is not None
        st = vm["status"]
        for field in ("consoleTail", "message"):
            assert not CONTROL.search(st[field]), (field, st[field])
            assert "clearedtitle" not in st[field] and "cleared" in st[field]

        def impvm_logs() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(
                [sys.executable, "-m", "impvm.cli", "logs", "-n", env.namespace, "escapes"],
                env=dict(os.environ, KUBECONFIG=str(control_plane.kubeconfig)),
                capture_output=True,
                timeout=60,
                check=False,
            )

        out = await asyncio.to_thread(impvm_logs)
        assert out.returncode == 0, out.stderr
        text = out.stdout.decode()
        assert not CONTROL.search(text), repr(text)
        for line in (
            "beforecleared",
            "title",
            "clipboard",
            "link",
            "red",  # the 8-bit CSI (U+009B) is a CSI like ESC [
            "rm -rf /ok      ",
            "secretcovert",
            "tab\there",
            "dcs-done",
        ):
            assert f"\n{line}\n" in f"\n{text}", (line, text)
        assert "owned-title" not in text and "ZWNobyBvd25lZA" not in text
        assert "attacker.example" not in text and "dcs payload" not in text
        raw = await asyncio.to_thread(Path(st["consoleLog"].partition(":")[2]).read_bytes)
        assert b"\x1b]52;" in raw  # the kept copy is the guest's bytes; only showing cleans
    finally:
        with contextlib.suppress(Exception):
            kube.delete(ImpVMClassResource, env.cls)
