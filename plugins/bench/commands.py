"""``ortcore bench``: the bench plugin's command (light: no torch at import; runs import :mod:`.suite`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ortcore.api import disabled_plugins, hookimpl, non_negative_int, positive_int

if TYPE_CHECKING:
    import rich.console

    from .suite import BenchSuite


@hookimpl
def ortcore_commands(subparsers: argparse._SubParsersAction) -> None:
    _add_bench(subparsers)


def _choice_list(kind: str, allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated subset of ``allowed``, keeping the user's order, no duplicates."""

    def parse(text: str) -> list[str]:
        names = [n.strip().lower() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind}s from: {', '.join(allowed)}")
        for name in names:
            if name not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {kind} {name!r}; allowed: {', '.join(allowed)}")
        return list(dict.fromkeys(names))

    return parse



#: Settings a flag of ``ortcore bench`` overrides in every configuration it runs.
_BENCH_OVERRIDES: tuple[str, ...] = ("steps", "warmup", "batch", "seq", "hidden", "layers", "vocab")


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from .suite import AMP_BASE_MODES, AMP_CHOICES, AMP_DTYPES, MODELS, MODES, PRESETS

    def preset_values(key: str) -> str:
        return ", ".join(f"{getattr(cfg, key)} {name}" for name, cfg in PRESETS.items())

    p = subparsers.add_parser(
        "bench",
        help="benchmark BERT and GPT-2 training under eager, torch.compile and ortcore",
        description=(
            "Train Hugging Face BertForSequenceClassification and GPT2LMHeadModel (random init, no download) "
            "with AdamW under each mode, every run in a fresh process, and print first-step time, steady step "
            "time, peak RSS and final loss, each with its ratio to eager. Exits 1 if any run failed."
        ),
        epilog=(
            "configs: "
            + "; ".join(
                f"{name} = hidden {c.hidden} × {c.layers} layers, batch {c.batch} × seq {c.seq}, {c.steps} steps"
                for name, c in PRESETS.items()
            )
            + ". `ortcore bench --from results.json --plot plot.png` redraws a saved run without running anything."
        ),
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--config",
        type=_choice_list("config", tuple(PRESETS)),
        help=f"comma-separated presets to run, each in turn: {', '.join(PRESETS)} (default: default)",
    )
    which.add_argument("--quick", action="store_true", help="same as --config quick: a short smoke run (modes eager, ortcore, ortcore-dynamo unless --modes)")
    p.add_argument("--models", type=_choice_list("model", MODELS), help=f"default: {','.join(MODELS)}")
    p.add_argument("--modes", type=_choice_list("mode", MODES), help=f"default: {','.join(MODES)}")
    p.add_argument("--steps", type=positive_int, help=f"training steps per run (config's: {preset_values('steps')})")
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        help=f"steps left out of the steady-state median (config's: {preset_values('warmup')})",
    )
    p.add_argument("--batch", type=positive_int, help=f"config's: {preset_values('batch')}")
    p.add_argument("--seq", type=positive_int, help=f"sequence length (config's: {preset_values('seq')})")
    p.add_argument("--hidden", type=positive_int, help=f"hidden size (config's: {preset_values('hidden')})")
    p.add_argument("--layers", type=positive_int, help=f"config's: {preset_values('layers')}")
    p.add_argument("--vocab", type=positive_int, help=f"vocabulary size (config's: {preset_values('vocab')})")
    p.add_argument(
        "--amp",
        choices=AMP_CHOICES,
        default="off",
        help=(
            f"mixed precision: beside each of {', '.join(AMP_BASE_MODES)} the modes name, one more row training "
            'with its forward under torch.autocast("cpu", dtype=...): '
            + ", ".join(f"{flag} = {dtype} (rows eager-{flag}, ...)" for flag, dtype in AMP_DTYPES.items())
            + "; ratios to eager of the same precision and to float32 eager; --explain profiles the autocast step "
            "(default: off)"
        ),
    )
    p.add_argument("--json", metavar="PATH", help="also write all results to PATH as JSON (atomically)")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw steady step time and memory added per model and mode into a PNG at PATH (needs matplotlib)",
    )
    p.add_argument(
        "--from",
        dest="from_json",
        metavar="JSON",
        help="run nothing: print the tables (and with --plot, draw the plot) of a file written by --json",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="after each config's runs, one more process per model shows where a step's time goes (op_profiler plugin)",
    )
    p.add_argument("--explain-only", action="store_true", help="only the --explain processes, no timed runs")
    p.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds before a single run is abandoned (default: 1800)"
    )
    p.set_defaults(run=_run_bench, parser=p)


def _check_out_path(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"{flag}: directory of {path!r} does not exist")


def _explain_unavailable() -> str | None:
    """Why ``--explain`` cannot run (the op_profiler plugin is disabled or not installed), or None."""
    from .suite import EXPLAIN_MODULE, EXPLAIN_PLUGIN

    if EXPLAIN_PLUGIN in disabled_plugins():
        why = "which is disabled ([plugins] disable in ortcore.toml or ORTCORE_DISABLE_PLUGINS)"
    elif importlib.util.find_spec(EXPLAIN_MODULE.partition(".")[0]) is None or (
        importlib.util.find_spec(EXPLAIN_MODULE) is None
    ):
        why = f"which is not installed (no module {EXPLAIN_MODULE})"
    else:
        return None
    return f"--explain needs the {EXPLAIN_PLUGIN} plugin, {why}"


def _bench_configs(args: argparse.Namespace) -> tuple[dict, dict[str, int]]:
    """The configurations to run, by name, with the command line's overrides applied, and the overrides."""
    from .suite import preset

    names = ["quick"] if args.quick else (args.config or ["default"])
    overrides = {k: getattr(args, k) for k in _BENCH_OVERRIDES if getattr(args, k) is not None}
    configs = {name: preset(name, **overrides) for name in names}
    for name, cfg in configs.items():
        if cfg.warmup >= cfg.steps:
            where = "" if {"steps", "warmup"} <= set(overrides) else f" (config {name!r})"
            args.parser.error(f"--warmup ({cfg.warmup}) must be less than --steps ({cfg.steps}){where}")
    return configs, overrides


def _run_bench(args: argparse.Namespace) -> int:
    from .suite import AMP_BASE_MODES, MODELS, MODES, QUICK_MODES, load_suite, plot_suite, run_suite, write_json

    parser: argparse.ArgumentParser = args.parser
    if args.from_json:
        given = [f"--{k.replace('_', '-')}" for k in ("config", "quick", "models", "modes", "explain", "explain_only",
                                                       "json", *_BENCH_OVERRIDES) if getattr(args, k)]  # fmt: skip
        given += ["--amp"] if args.amp != "off" else []
        if given:
            parser.error(f"--from redraws a saved run; {', '.join(given)} would need a new one")
    else:
        configs, overrides = _bench_configs(args)
    _check_out_path(parser, "--json", args.json)
    _check_out_path(parser, "--plot", args.plot)
    needed = ["rich"] + ([] if args.from_json else ["transformers"]) + (["matplotlib"] if args.plot else [])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ortcore bench needs {' and '.join(missing)}: pip install 'ortcore[all]'", file=sys.stderr)
        return 2
    explain = args.explain or args.explain_only
    if explain and (problem := _explain_unavailable()):
        print(f"ortcore bench: {problem}", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.markup import escape

    if args.from_json:
        try:
            suite = load_suite(args.from_json)
        except ValueError as e:
            parser.error(f"--from: {e}")
    else:
        progress = Console(stderr=True)

        def on_start(label: str, i: int, n: int) -> None:
            progress.print(f"[{i}/{n}] {label} ...", highlight=False, markup=False)

        def on_done(ok: bool, wall_s: float, what: str, i: int, n: int) -> None:
            what = escape(what) if ok else f"[red]{escape(what)}[/red]"  # ORT messages contain [brackets]
            progress.print(f"      done in {wall_s:.0f} s: {what}", highlight=False)

        modes = args.modes or list(QUICK_MODES if args.quick else MODES)
        if args.amp != "off" and not args.explain_only and not set(modes) & set(AMP_BASE_MODES):
            parser.error(
                f"--amp {args.amp} adds autocast rows for {', '.join(AMP_BASE_MODES)}; --modes names none of them"
            )
        if args.quick and not args.modes:
            progress.print(
                f"a smoke run: modes {', '.join(QUICK_MODES)}; "
                f"{', '.join(m for m in MODES if m not in QUICK_MODES)} left out (torch.compile's cold compile and the "
                "second processes of the cached modes are most of a full run's time; --modes names them)",
                highlight=False,
                markup=False,
            )
        suite = run_suite(
            args.models or list(MODELS),
            [] if args.explain_only else modes,
            configs,
            overrides=overrides,
            explain=explain,
            on_start=on_start,
            on_done=on_done,
            timeout_s=args.timeout,
            amp=args.amp,
        )
    # Piped output gets rich's 80 columns unless told otherwise, too narrow for nine columns and ratios.
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    _print_suite(console, suite)
    if args.json:
        write_json(suite, args.json)
        console.print(f"results written to {args.json}", highlight=False, markup=False)
    if args.plot:
        try:
            plot_suite(suite, args.plot)
        except ValueError as e:
            print(f"ortcore bench: --plot: {e}", file=sys.stderr)
            return 1
        console.print(f"plot written to {args.plot}", highlight=False, markup=False)
    return 0 if suite.ok else 1


def _print_suite(console: rich.console.Console, suite: BenchSuite) -> None:
    """Each configuration's table and summary, then its explain data (rendered by the op_profiler plugin)."""
    from .suite import EXPLAIN_MODULE, results_table, summary_lines

    for report in suite.reports:
        if report.results:
            console.print(results_table(report))
            for line in summary_lines(report):
                console.print(line, highlight=False, markup=False)
        for model, data in report.explain.items():
            console.print(f"\nwhere the time goes, config {report.name!r}, {model}:", highlight=False, markup=False)
            try:
                from importlib import import_module

                console.print(import_module(EXPLAIN_MODULE).render_explain(data))
            except ImportError:
                console.print(f"(saved in the JSON; {EXPLAIN_MODULE} renders it)", highlight=False, markup=False)
        for model, error in report.explain_errors.items():
            console.print(f"explain {report.name}/{model} FAILED: {error}", style="red", highlight=False, markup=False)
    if len(suite.reports) > 1:
        console.print(f"all configs: total wall time {suite.wall_s:.0f} s", highlight=False, markup=False)
