"""The ``ortcore`` subcommands of activation_stats: ``find-divergence`` and ``merge-activation-summary``.

This module is the plugin's entry in the ``ortcore.commands`` entry-point group, which ``ortcore --help`` loads: it
declares the arguments and imports the tools (and with them torch) only inside the run functions.
"""

from __future__ import annotations

import argparse
from typing import Any

from ortcore.api import hookimpl

from .arguments import (
    EXIT_CODES,
    FIND_DIVERGENCE_DESCRIPTION,
    MERGE_DESCRIPTION,
    add_find_divergence_arguments,
    add_merge_arguments,
)


def _run_find_divergence(args: argparse.Namespace) -> int:
    from .divergence import run

    return run(args)


def _run_merge(args: argparse.Namespace) -> int:
    from .merge_activation_summary import run

    return run(args)


@hookimpl
def ortcore_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "find-divergence",
        help="report the first step and activation where two activation-statistics runs differ (exit 1 if any)",
        description=FIND_DIVERGENCE_DESCRIPTION,
        epilog=EXIT_CODES,
    )
    add_find_divergence_arguments(p)
    p.set_defaults(run=_run_find_divergence)
    p = subparsers.add_parser(
        "merge-activation-summary",
        help="write per-step summaries of a PyTorch and an ortcore activation-statistics run side by side",
        description=MERGE_DESCRIPTION,
    )
    add_merge_arguments(p)
    p.set_defaults(run=_run_merge)
