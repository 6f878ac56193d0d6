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
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .config import disabled_plugins
from .tables import Column

if TYPE_CHECKING:
    import pluggy


# -- ortcore plugins / config / doctor -----------------------------------------------------------------------------
def _add_layout_flags(p: argparse.ArgumentParser) -> None:
    layout = p.add_mutually_exclusive_group()
    layout.add_argument(
        "--wide", action="store_true", help="the table at its full width, nothing wrapped (wide terminals, logs)"
    )
    layout.add_argument("--json", action="store_true", help="print every field as JSON on stdout, and nothing else")


def _add_plugins(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plugins",
        help="list installed plugins: version, source, enabled, hooks, options",
        description="List every plugin found through the 'ortcore.plugins' entry points, loaded or not. The table "
        "fits the terminal (COLUMNS); where it cannot without breaking a name, each plugin is a block of lines.",
    )
    _add_layout_flags(p)
    p.set_defaults(run=_run_plugins)


def _host_or_error():
    from .report import load_host

    host, error = load_host()
    if host is None:
        print(f"ortcore: configuration error: {error}", file=sys.stderr)
    return host


def _print_json(data: object) -> None:
    import json

    print(json.dumps(data, indent=2))


def _print_table(
    title: str, columns: Sequence[Column], rows: list[Sequence[str]], footer: Sequence[str], wide: bool
) -> None:
    """A rich table as wide as the terminal (:func:`~ortcore.tables.terminal_width`), prose wrapped, names never
    broken; one block per row (:func:`~ortcore.tables.stacked`) if the names do not fit, or without rich. ``wide``:
    the table at its natural width, whatever the terminal's."""
    from .tables import fit_widths, stacked, terminal_width, wrap

    width = None if wide else terminal_width()
    widths = fit_widths(columns, rows, width)
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # rich is optional: the stacked layout needs none of it
        widths = None
    page = width or 10**9
    for line in wrap(title, page):
        print(line)
    if widths is None:
        for line in stacked(columns, rows, page):
            print(line)
    else:
        table = Table()
        for column, w in zip(columns, widths):
            if column.prose:  # rich wraps it between words; fit_widths left room for the longest
                table.add_column(column.header, width=w, overflow="fold")
            else:  # names: broken only where wrap() allows, never by rich
                table.add_column(column.header, width=w, no_wrap=True)
        for row in rows:
            table.add_row(
                *(Text(cell if c.prose else "\n".join(wrap(cell, w))) for c, w, cell in zip(columns, widths, row))
            )
        Console(width=sum(widths) + 3 * len(widths) + 1).print(table)
    for note in footer:
        for line in wrap(note, page):
            print(line)


PLUGIN_COLUMNS = (
    Column("name"),
    Column("version"),
    Column("source"),
    Column("enabled", prose=True),
    Column("hooks", own_line=True),
    Column("options", own_line=True),
)


def _run_plugins(args: argparse.Namespace) -> int:
    from .report import plugin_rows

    host = _host_or_error()
    if host is None:
        return 1
    found = plugin_rows(host)
    path = str(host.config.path) if host.config.path else None
    if args.json:
        _print_json(
            {
                "configuration": path,
                "plugins": [
                    {
                        "name": r.name,
                        "version": r.version,
                        "source": r.source,
                        "enabled": r.enabled,
                        "hooks": list(r.hooks),
                        "options": dict(o.split("=", 1) for o in r.options),
                    }
                    for r in found
                ],
            }
        )
        return 0
    rows = [
        (
            r.name,
            r.version,
            r.source,
            r.enabled,
            ", ".join(h.removeprefix("ortcore_") for h in r.hooks),
            "\n".join(r.options),
        )
        for r in found
    ]
    _print_table("ortcore plugins", PLUGIN_COLUMNS, rows, [f"configuration: {path}"] if path else [], args.wide)
    return 0


def _add_config(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config",
        help="show the effective configuration and where each value came from",
        description="Every core and plugin option: its value, its source (default, file, argument, env) and its "
        "environment variable. The table fits the terminal (COLUMNS); where it cannot without breaking a name, each "
        "option is a block of lines.",
    )
    _add_layout_flags(p)
    p.set_defaults(run=_run_config)


CONFIG_COLUMNS = (
    Column("key"),
    Column("value"),
    Column("source"),
    Column("env"),
    Column("meaning", prose=True, label=False),
)


def _run_config(args: argparse.Namespace) -> int:
    from .report import config_rows

    host = _host_or_error()
    if host is None:
        return 1
    found = config_rows(host)
    path = str(host.config.path) if host.config.path else None
    if args.json:
        _print_json(
            {
                "configuration": path,
                "options": [
                    {"key": r.key, "value": r.value, "source": r.source, "env": r.env or None, "meaning": r.doc}
                    for r in found
                ],
                "plugins_disabled": list(host.config.disable),
            }
        )
        return 0
    _print_table(
        f"ortcore configuration ({path or 'no ortcore.toml found'})",
        CONFIG_COLUMNS,
        [(r.key, r.value, r.source, r.env, r.doc) for r in found],
        [f"plugins disabled: {', '.join(host.config.disable) or 'none'}"],
        args.wide,
    )
    return 0


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_plugins,
    _add_config,
)


# -- plugin commands ---------------------------------------------------------------------------------------------
# Plugins that add commands name a light module here too (same plugin name as in ortcore.plugins), so that building
# the command line imports no plugin's main module, and no torch.
COMMANDS_ENTRY_POINT_GROUP = "ortcore.commands"


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
                f"ortcore: plugin {name!r} failed to add its commands (hook ortcore_commands): {type(e).__name__}: {e}",
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

    disabled = disabled_plugins()
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
    except BrokenPipeError:  # `ortcore config | head`: the reader left; no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
