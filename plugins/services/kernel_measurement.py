"""What kernel measurement cost this process, as the plugin that measures publishes it (``aten_fallback``'s kernel
choice registers its reporters here at import); read by other plugins (``demo``, ``explain``) without importing it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_reporters: dict[str, Callable[..., Any]] = {}


def publish(**reporters: Callable[..., Any]) -> None:
    """Register reporters by name: ``record()`` (the measurement record), ``summary()`` (one text)."""
    _reporters.update(reporters)


def record() -> Any:
    """The measurement record, or None when no plugin measures."""
    report = _reporters.get("record")
    return report() if report else None


def summary() -> str:
    report = _reporters.get("summary")
    return report() if report else ""
