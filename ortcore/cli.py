"""The ``ortcore`` console command.

Each core subcommand is a pair of functions: ``_add_<name>(subparsers)`` declares its arguments and binds
``_run_<name>(args) -> int``. To add one, write both and append the first to :data:`_SUBCOMMANDS`. Plugins add
theirs through the ``ortcore_commands`` hook (docs/cli.md), from light modules named in the ``ortcore.commands``
entry-point group. Building the parser imports no torch: heavy and optional dependencies (torch, transformers,
rich) are imported inside the run functions that need them, so ``ortcore --help`` and ``--version`` stay fast and
the other subcommands work without the optional ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .argtypes import non_negative_int, positive_int

if TYPE_CHECKING:
    import pluggy
    import rich.console

    from .bench import BenchSuite


# -- argument types ----------------------------------------------------------------------------------------------
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


# -- ortcore demo ------------------------------------------------------------------------------------------------
def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small model in PyTorch and in ortcore and compare the loss curves",
        description=(
            "Train a small seeded transformer-style model with AdamW twice, in plain PyTorch and wrapped in "
            "ortcore.ORTModule, from identical weights and data; print both loss curves and step times. "
            "Exits nonzero if the curves differ by more than the tolerance or ortcore fell back to PyTorch."
        ),
    )
    p.add_argument("--steps", type=positive_int, default=20, help="training steps per run (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default: 0)")
    p.set_defaults(run=_run_demo)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(steps=args.steps, seed=args.seed)
    print(
        f"ortcore demo: {cfg.steps} AdamW steps (lr {cfg.lr:g}) of a one-block transformer-style model "
        f"(dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab}), batch {cfg.batch} × seq {cfg.seq}, seed {cfg.seed}",
        flush=True,
    )
    print("training in PyTorch, then with ortcore.ORTModule from the same initial weights ...", flush=True)
    result = run_demo(cfg)
    print(f"model parameters: {result.n_params:,}\n")
    from .tables import format_table

    rows = zip(
        result.torch_run.losses,
        result.ortcore_run.losses,
        result.rel_diffs,
        result.torch_run.step_times_s,
        result.ortcore_run.step_times_s,
    )
    table = [
        (i, f"{a:.6f}", f"{b:.6f}", f"{d:.1e}", f"{ta * 1e3:.1f}", f"{tb * 1e3:.1f}", "export + build + step" if i == 1 else "")
        for i, (a, b, d, ta, tb) in enumerate(rows, 1)
    ]
    print(format_table(("step", "torch loss", "ortcore loss", "rel diff", "torch ms", "ortcore ms", ""), table, indent=""))
    print()
    t, o = result.torch_run, result.ortcore_run
    if not result.ran_in_ort:
        verdict = f"FAIL: ortcore fell back to PyTorch ({result.fallback_reason})"
    elif result.passed:
        verdict = f"OK (limit {cfg.tolerance:.0e})"
    else:
        verdict = f"FAIL: curves differ by more than {cfg.tolerance:.0e}"
    print(
        f"summary: max rel loss diff {result.max_rel_diff:.1e} | first step: torch {_ms(t.first_step_s)}, "
        f"ortcore {_ms(o.first_step_s)} | median steady step: torch {_ms(t.steady_step_s)}, "
        f"ortcore {_ms(o.steady_step_s)} | {verdict}"
    )
    print(
        "note: a model this small mostly measures fixed per-step overheads; "
        "`ortcore bench` compares BERT and GPT-2 at realistic sizes."
    )
    return 0 if result.passed else 1


# -- ortcore bench -----------------------------------------------------------------------------------------------
#: Settings a flag of ``ortcore bench`` overrides in every configuration it runs.
_BENCH_OVERRIDES: tuple[str, ...] = ("steps", "warmup", "batch", "seq", "hidden", "layers", "vocab")


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from .bench import MODELS, MODES, PRESETS

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
    which.add_argument("--quick", action="store_true", help="same as --config quick: a short smoke run of everything")
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
    from .bench import EXPLAIN_MODULE, EXPLAIN_PLUGIN

    if EXPLAIN_PLUGIN in _disabled_plugins():
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
    from .bench import preset

    names = ["quick"] if args.quick else (args.config or ["default"])
    overrides = {k: getattr(args, k) for k in _BENCH_OVERRIDES if getattr(args, k) is not None}
    configs = {name: preset(name, **overrides) for name in names}
    for name, cfg in configs.items():
        if cfg.warmup >= cfg.steps:
            where = "" if {"steps", "warmup"} <= set(overrides) else f" (config {name!r})"
            args.parser.error(f"--warmup ({cfg.warmup}) must be less than --steps ({cfg.steps}){where}")
    return configs, overrides


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import MODELS, MODES, load_suite, plot_suite, run_suite, write_json

    parser: argparse.ArgumentParser = args.parser
    if args.from_json:
        given = [f"--{k.replace('_', '-')}" for k in ("config", "quick", "models", "modes", "explain", "explain_only",
                                                       "json", *_BENCH_OVERRIDES) if getattr(args, k)]  # fmt: skip
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

        suite = run_suite(
            args.models or list(MODELS),
            [] if args.explain_only else (args.modes or list(MODES)),
            configs,
            overrides=overrides,
            explain=explain,
            on_start=on_start,
            on_done=on_done,
            timeout_s=args.timeout,
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
    from .bench import EXPLAIN_MODULE, results_table, summary_lines

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


# -- ortcore plugins / config / doctor -----------------------------------------------------------------------------
def _add_plugins(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plugins",
        help="list installed plugins: version, source, enabled, hooks, options",
        description="List every plugin found through the 'ortcore.plugins' entry points, loaded or not.",
    )
    p.set_defaults(run=_run_plugins)


def _host_or_error():
    from .report import load_host

    host, error = load_host()
    if host is None:
        print(f"ortcore: configuration error: {error}", file=sys.stderr)
    return host


def _print_table(title: str, columns: Sequence[str], rows: list[Sequence[str]]) -> None:
    """A rich table; piped output gets a fixed width wide enough for the option columns."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def _run_plugins(args: argparse.Namespace) -> int:
    from .report import plugin_rows

    host = _host_or_error()
    if host is None:
        return 1
    rows = [
        (r.name, r.version, r.source, r.enabled, ", ".join(h.removeprefix("ortcore_") for h in r.hooks), "\n".join(r.options))
        for r in plugin_rows(host)
    ]
    _print_table("ortcore plugins", ("name", "version", "source", "enabled", "hooks", "options"), rows)
    if host.config.path:
        print(f"configuration: {host.config.path}")
    return 0


def _add_config(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config",
        help="show the effective configuration and where each value came from",
        description="Every core and plugin option: its value, its source (default, file, argument, env) and its "
        "environment variable.",
    )
    p.set_defaults(run=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    from .report import config_rows

    host = _host_or_error()
    if host is None:
        return 1
    _print_table(
        f"ortcore configuration ({host.config.path or 'no ortcore.toml found'})",
        ("key", "value", "source", "env", "meaning"),
        [(r.key, r.value, r.source, r.env, r.doc) for r in config_rows(host)],
    )
    print(f"plugins disabled: {', '.join(host.config.disable) or 'none'}")
    return 0


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check versions, training bindings, environment and plugins; suggest a fix for each problem",
        description="Check the installation and run one training step of a tiny model against PyTorch.",
    )
    p.add_argument("--no-smoke", action="store_true", help="skip the one-step training check")
    p.set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from .report import doctor, load_host, smoke_test

    host, error = load_host()
    findings = doctor(host, error)
    if not args.no_smoke and not any(f.level == "error" for f in findings):
        findings.append(smoke_test())
    marks = {"ok": "ok     ", "warning": "warning", "error": "ERROR  "}
    for f in findings:
        print(f"{marks[f.level]} {f.what}")
        if f.fix:
            print(f"        fix: {f.fix}")
    problems = sum(f.level != "ok" for f in findings)
    print(f"{problems} problem(s) found" if problems else "no problems found")
    return 1 if any(f.level == "error" for f in findings) else 0


# -- ortcore explain ---------------------------------------------------------------------------------------------
def _add_explain(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "explain",
        help="train one step of a model and show where each op kind runs (ORT or PyTorch kernel) and why",
        description=(
            "Build a model, run one training step through ORTModule and print, per op kind of the training graph, "
            "where it runs (ONNX Runtime's kernel or PyTorch's) in forward and backward, and why an op was routed. "
            "MODEL is 'bert' or 'gpt2' (small configs, random weights) or 'package.module:function', a function "
            "returning (model, inputs) where inputs is a dict of keyword arguments or a tuple of positional ones."
        ),
    )
    p.add_argument("model", help="bert, gpt2, or package.module:function")
    p.set_defaults(run=_run_explain, parser=p)


def _explain_target(spec: str, parser: argparse.ArgumentParser):
    import importlib

    if spec in ("bert", "gpt2"):
        from .bench import BenchConfig, build_model, make_batches

        cfg = BenchConfig(batch=2, seq=32, hidden=64, layers=2, steps=1, warmup=0, vocab=500)
        return build_model(spec, cfg), make_batches(spec, cfg)[0]
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        parser.error(f"model {spec!r}: expected bert, gpt2 or package.module:function")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        parser.error(f"model {spec!r}: cannot load {function_name!r} from {module_name!r}: {e}")
    return factory()


def _run_explain(args: argparse.Namespace) -> int:
    import torch
    import torch.utils._pytree as pytree

    from . import ORTModule

    model, inputs = _explain_target(args.model, args.parser)
    wrapped = ORTModule(model)
    outputs = wrapped(**inputs) if isinstance(inputs, dict) else wrapped(*inputs)
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        sum(t.float().sum() for t in leaves).backward()
    if wrapped.fallback_reason is not None:
        print(f"the model runs in PyTorch: {wrapped.fallback_reason}")
        return 1
    print(wrapped.explain())
    routed = wrapped.explain().routed()
    print(f"{len(routed)} op kind(s) run on PyTorch's kernels inside the ORT graph" if routed else "every op runs in ORT")
    return 0


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_demo,
    _add_bench,
    _add_plugins,
    _add_config,
    _add_doctor,
    _add_explain,
)


# -- plugin commands ---------------------------------------------------------------------------------------------
# Plugins that add commands name a light module here too (same plugin name as in ortcore.plugins), so that building
# the command line imports no plugin's main module, and no torch.
COMMANDS_ENTRY_POINT_GROUP = "ortcore.commands"


def _disabled_plugins() -> set[str]:
    """``[plugins] disable`` and ``ORTCORE_DISABLE_PLUGINS``; from the environment alone if ortcore.toml is broken
    (``ortcore config`` then names the problem: --help must still work)."""
    from .config import Config
    from .errors import OptionError

    try:
        return set(Config.load().disable)
    except (OptionError, OSError, ValueError):
        return {n.strip() for n in os.environ.get("ORTCORE_DISABLE_PLUGINS", "").split(",") if n.strip()}


def _add_commands_of(pm: pluggy.PluginManager, subparsers: argparse._SubParsersAction, skip: set[str]) -> set[str]:
    """Call ``ortcore_commands`` of every plugin in ``pm`` not named in ``skip``, in registration order; a plugin
    that fails is reported on stderr and the others keep working. Returns the names of the plugins called."""
    called = set()
    names = [impl.plugin_name for impl in reversed(pm.hook.ortcore_commands.get_hookimpls())]
    for name in dict.fromkeys(names):
        if name in skip:
            continue
        called.add(name)
        # Through pluggy, one plugin at a time (its own hook wrappers apply), so that one failing plugin is named
        # and the others keep their commands.
        others = [pm.get_plugin(other) for other in names if other != name]
        try:
            pm.subset_hook_caller("ortcore_commands", remove_plugins=others)(subparsers=subparsers)
        except Exception as e:  # a broken plugin must not take the other commands down
            print(
                f"ortcore: plugin {name!r} failed to add its commands (hook ortcore_commands): "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
            )
    return called


def _add_light_plugin_commands(subparsers: argparse._SubParsersAction) -> set[str]:
    """The fast path: the plugins' light command modules, entry-point group ``ortcore.commands`` (same plugin name as
    in ``ortcore.plugins``), in a plugin manager of their own: nothing else of any plugin is imported. A disabled
    plugin's commands are left out. Returns the names of the plugins whose commands were added."""
    import importlib_metadata
    import pluggy

    from . import hookspecs

    disabled = _disabled_plugins()
    pm = pluggy.PluginManager("ortcore")
    pm.add_hookspecs(hookspecs)
    for ep in importlib_metadata.entry_points(group=COMMANDS_ENTRY_POINT_GROUP):
        if ep.name in disabled or pm.has_plugin(ep.name):
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as e:  # as with plugins: one that fails to import leaves the others working
            dist = ep.dist.name if ep.dist else "<unknown>"
            print(
                f"ortcore: the commands of plugin {ep.name!r} (distribution {dist!r}, entry point {ep.value!r}) "
                f"failed to load: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
    return _add_commands_of(pm, subparsers, set())


def _add_all_plugin_commands(subparsers: argparse._SubParsersAction, skip: set[str]) -> None:
    """The slow path, for a command not found among the light ones: load every plugin (``ortcore.plugins``, torch
    included) and add the commands of those that implement ``ortcore_commands`` in their main module."""
    host = _host_or_error()
    if host is not None:
        _add_commands_of(host.pm, subparsers, skip)


def _command_word(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: the first word that is not an option (the top level has only flags)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``ortcore`` argument parser: the core's subcommands and the plugins' (``ortcore_commands``).

    Plugin commands come from the light modules of the ``ortcore.commands`` entry points; only when ``argv`` names a
    command found neither there nor in the core are all plugins loaded, for plugins that add commands from their
    main module.
    """
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="ortcore",
        description="Train PyTorch models in ONNX Runtime's training engine.",
        epilog="Plugins add commands through the ortcore_commands hook; `ortcore plugins` lists the plugins.",
    )
    parser.add_argument("--version", action="version", version=f"ortcore {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    light = _add_light_plugin_commands(subparsers)
    command = _command_word(argv or ())
    if command is not None and command not in subparsers.choices:
        _add_all_plugin_commands(subparsers, skip=light)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ortcore`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on bad arguments; callers of main() want a code
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except SystemExit as e:  # parser.error() inside a subcommand's checks
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
