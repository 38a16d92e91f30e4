"""Typed status patches and their one serialisation.

A patch is a model of :mod:`impvm.api.models` (``ImpVMStatus``, ``ImpVMRunnerPoolStatus``)
constructed with only the fields it changes; :func:`wire` turns it into the JSON merge patch
(RFC 7386) the API server applies: the fields set, by their wire names, recursively; a field
set to None is sent as null, which removes it. Times are written as given: a builder that
writes a ``metav1.Time`` (whole seconds, Kubernetes API conventions) passes
:func:`whole_seconds` of its clock reading.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from impvm.api.models import ApiModel

__all__ = ["whole_seconds", "wire"]


def wire(patch: ApiModel) -> dict[str, Any]:
    """The merge-patch body of ``patch``: its set fields by wire name, None as null."""
    out: dict[str, Any] = patch.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return out


def whole_seconds(t: dt.datetime) -> dt.datetime:
    """``t`` in UTC, truncated to whole seconds (how Kubernetes writes a ``metav1.Time``)."""
    return t.astimezone(dt.UTC).replace(microsecond=0)
