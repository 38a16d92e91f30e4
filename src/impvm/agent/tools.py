"""Running the host tools the agent relies on (skopeo, umoci, mkfs, qemu-img, ...)."""

from __future__ import annotations

import asyncio


class ToolError(Exception):
    """A tool exited non-zero; the message names what was attempted, the exit status and the
    tail of the tool's error output (tools never see a JIT config, so no secret can be in it)."""


async def run_tool(what: str, *args: str, error: type[Exception] = ToolError) -> bytes:
    """Run ``args`` without a shell or stdin; return its stdout. On a non-zero exit raise
    ``error`` (default :class:`ToolError`) with ``what``, the exit status and the last 1000
    characters of stderr (or stdout when stderr is empty)."""
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        detail = (err or out).decode(errors="replace").strip()[-1000:]
        raise error(f"{what} failed (exit {proc.returncode}): {detail}")
    return out
