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
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .config import disabled_plugins

if TYPE_CHECKING:
    import pluggy


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
        (
            r.name,
            r.version,
            r.source,
            r.enabled,
            ", ".join(h.removeprefix("ortcore_") for h in r.hooks),
            "\n".join(r.options),
        )
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


if __name__ == "__main__":
    sys.exit(main())
