"""The command-line arguments of activation_stats' tools, shared by the ``ortcore`` subcommands (:mod:`.commands`)
and the tools' own ``python -m`` entry points (:mod:`.divergence`, :mod:`.merge_activation_summary`)."""

from __future__ import annotations

import argparse

from ortcore.api import non_negative_float, non_negative_int

FIND_DIVERGENCE_DESCRIPTION = (
    "Compare a PyTorch run and an ortcore run of StatisticsSubscriber records: the first divergence in execution "
    "order, a ranked table of the worst activations, and an HTML report with plots, written by default to "
    "divergence_<PT_DIR name>_vs_<ORT_DIR name>.html in the current directory."
)
EXIT_CODES = "Exit codes: 0 no divergence, 1 divergence found, 2 bad input."
MERGE_DESCRIPTION = "Merge two StatisticsSubscriber output directories into one side-by-side text file per step."


def add_find_divergence_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``find-divergence``."""
    parser.add_argument("pt_dir", metavar="PT_DIR", help="PyTorch run dir, or a parent of rank_<r>/ run dirs")
    parser.add_argument("ort_dir", metavar="ORT_DIR", help="ortcore run dir, or a parent of rank_<r>/ run dirs")
    parser.add_argument("--rtol", type=non_negative_float, default=1e-3, help="relative tolerance (default 1e-3)")
    parser.add_argument("--atol", type=non_negative_float, default=1e-6, help="absolute tolerance (default 1e-6)")
    parser.add_argument("--top", type=non_negative_int, default=20, help="rows of the ranked table (default 20)")
    html = parser.add_mutually_exclusive_group()
    html.add_argument(
        "--html",
        metavar="PATH",
        help="write the HTML report to PATH (default: divergence_<PT_DIR name>_vs_<ORT_DIR name>.html here)",
    )
    html.add_argument("--no-html", action="store_true", help="do not write the HTML report")


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``merge-activation-summary``."""
    parser.add_argument(
        "--pt_dir", "--pt-dir", nargs="+", required=True, help="PyTorch run dir(s), or a parent of rank_<r>/"
    )
    parser.add_argument(
        "--ort_dir", "--ort-dir", nargs="+", required=True, help="ortcore run dir(s), or a parent of rank_<r>/"
    )
    parser.add_argument("--output_dir", "--output-dir", required=True, help="where step_<N>.txt files are written")


def divergence_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of ``find-divergence``'s arguments (``python -m ...divergence``)."""
    parser = argparse.ArgumentParser(prog="find-divergence", description=FIND_DIVERGENCE_DESCRIPTION, epilog=EXIT_CODES)
    add_find_divergence_arguments(parser)
    return parser


def merge_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of ``merge-activation-summary``'s arguments."""
    parser = argparse.ArgumentParser(prog="merge-activation-summary", description=MERGE_DESCRIPTION)
    add_merge_arguments(parser)
    return parser
