"""Text a guest wrote, made safe to show on a terminal or to put in an API object.

A VM's console holds bytes its job chose. Printed as they are, a terminal obeys the control
functions among them (ECMA-48 "Control Functions for Coded Character Sets", and xterm's
extensions): CSI sequences move the cursor, erase the screen and recolour text; OSC strings set
the window title, write the clipboard (OSC 52) or make links (OSC 8); DCS, SOS, PM and APC
strings reach the terminal's own parsers; a carriage return or backspace overwrites what came
before it, so a line can hide behind another. :func:`printable` removes every escape sequence
(introduced by ``ESC`` or in its 8-bit C1 form), every other C0 and C1 control character and
DEL, and keeps line feeds and tabs; bytes that are not UTF-8 become U+FFFD. ``kubectl`` prints
object fields unescaped, so the agent cleans a console tail the same way before it reaches a
VM's status or an Event.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile(
    r"""
      (?:\x1b\[|\x9b) [\x30-\x3f]* [\x20-\x2f]* [\x40-\x7e]?   # CSI: parameters, final byte
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]) .*? (?:\x07|\x1b\\|\x9c|\Z)
                                                             # OSC, DCS, SOS, PM, APC to ST/BEL
    | \x1b [\x20-\x2f]* [\x30-\x7e]?                         # other escape sequences
    | [\x00-\x08\x0b-\x1f\x7f-\x9f]                          # every other control, DEL
    """,
    re.VERBOSE | re.DOTALL,
)


def printable(data: bytes | str) -> str:
    """``data`` (bytes are decoded as UTF-8, errors replaced) without terminal control
    sequences or control characters but line feeds and tabs."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return _CONTROLS.sub("", text)
