"""Post-export graph passes and their ordering.

Plugins contribute :class:`GraphPass` objects through ``ortcore_graph_passes``. pluggy calls plugins
last-registered-first, so the order of passes is never taken from registration: each pass names the passes it must
run ``before`` or ``after``, and :func:`order_passes` sorts them (stable by name otherwise), failing loudly on a
cycle, an unknown name or a duplicate name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import onnx

from .errors import OptionError


@attrs.frozen
class PassContext:
    """What a pass may read besides the graph: the module, whether it was exported for training, the config."""

    module: Any
    training: bool
    config: Any


@attrs.frozen
class GraphPass:
    """A named edit of the exported forward graph, run in place before the gradient graph is built.

    Example::

        GraphPass("fold_scale", run=fold_scale, after=("core",))
    """

    name: str
    run: Callable[[onnx.ModelProto, PassContext], None] = attrs.field(eq=False)
    before: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    after: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    plugin: str = ""


def order_passes(passes: Iterable[GraphPass]) -> list[GraphPass]:
    """Topologically sort passes by their ``before``/``after`` constraints."""
    passes = list(passes)
    by_name: dict[str, GraphPass] = {}
    for p in passes:
        if p.name in by_name:
            raise OptionError(
                f"graph pass name {p.name!r} is declared twice (plugins {by_name[p.name].plugin!r} and {p.plugin!r})"
            )
        by_name[p.name] = p
    edges: dict[str, set[str]] = {name: set() for name in by_name}  # name -> passes that must run first
    for p in passes:
        for other in (*p.before, *p.after):
            if other not in by_name:
                raise OptionError(
                    f"graph pass {p.name!r} (plugin {p.plugin!r}) orders itself against unknown pass {other!r}; "
                    f"known: {sorted(by_name)}"
                )
        for other in p.after:
            edges[p.name].add(other)
        for other in p.before:
            edges[other].add(p.name)
    ordered: list[GraphPass] = []
    done: set[str] = set()
    while len(ordered) < len(by_name):
        ready = sorted(n for n, deps in edges.items() if n not in done and deps <= done)
        if not ready:
            cycle = sorted(n for n in by_name if n not in done)
            raise OptionError(f"graph passes {cycle} order themselves in a cycle (before/after)")
        for name in ready:
            ordered.append(by_name[name])
            done.add(name)
    return ordered
