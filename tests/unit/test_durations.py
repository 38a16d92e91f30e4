from __future__ import annotations

import pytest

from impvm.api.durations import parse_duration, resolve_expire_after


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0s", 0.0),
        ("90s", 90.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("250ms", 0.25),
        ("2h0m5s", 7205.0),
    ],
)
def test_parse(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "1d", "s", "1h 2m", "-1s", "1hx"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_resolve_order() -> None:
    assert resolve_expire_after(None, "2m", "1h") == 120.0
    assert resolve_expire_after("0s", "2m") is None
    assert resolve_expire_after(None, None) is None
