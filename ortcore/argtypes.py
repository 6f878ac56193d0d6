"""argparse types shared by the ``ortcore`` subcommands: bounded numbers whose errors name the bad value."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def bounded(cast: Callable[[str], float], minimum: float, what: str) -> Callable[[str], float]:
    """An argparse type converting with ``cast`` and accepting values >= ``minimum``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= minimum:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = what.replace(" ", "_")
    return parse


positive_int = bounded(int, 1, "a positive integer")
non_negative_int = bounded(int, 0, "a non-negative integer")
non_negative_float = bounded(float, 0.0, "a non-negative number")
