"""Post-export graph passes and their ordering.

Plugins contribute :class:`GraphPass` objects through ``ortcore_graph_passes``. pluggy calls plugins
last-registered-first, so the order of passes is never taken from registration: each pass names the passes it must
run ``before`` or ``after``, and :func:`order_passes` sorts them (``graphlib``; by name among the passes ready at
the same time), failing loudly on a cycle, an unknown name or a duplicate name.
"""

from __future__ import annotations

import graphlib
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import onnx

from .errors import OptionError


@attrs.frozen
class PassContext:
    """What a pass may read besides the graph: the module, whether it was exported for training, the config, and
    (passes over the dynamo route's exported program) the ops plugins' onnxscript translations cover."""

    module: Any
    training: bool
    config: Any
    translated: frozenset = frozenset()


class ValueNames:
    """Hands out value names that no node, input, output, initializer or value_info of a graph uses yet: what a pass
    needs to add nodes without clashing with the exporter's names or another pass's."""

    def __init__(self, graph: onnx.GraphProto):
        self.taken = {name for node in graph.node for name in (*node.input, *node.output)}
        self.taken.update(v.name for v in (*graph.input, *graph.output, *graph.value_info))
        self.taken.update(t.name for t in graph.initializer)

    def fresh(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2``, ... if taken; the name is taken from then on."""
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def int64s(self, base: str, values: list[int]) -> tuple[str, onnx.NodeProto]:
        """A ``Constant`` node holding ``values`` as a 1-D int64 tensor (axes, shapes), and its output's name."""
        name = self.fresh(base)
        tensor = onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
        return name, onnx.helper.make_node("Constant", [], [name], name=name, value=tensor)


def splice(graph: onnx.GraphProto, replaced: dict[int, list[onnx.NodeProto]]) -> None:
    """Replace the node at each position of ``replaced`` by its list of nodes, keeping the graph's order."""
    nodes: list[onnx.NodeProto] = []
    for position, node in enumerate(graph.node):
        nodes.extend(replaced.get(position, [node]))
    del graph.node[:]
    graph.node.extend(nodes)


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
    """Topologically sort passes by their ``before``/``after`` constraints; among passes ready at the same time, by
    name, so the order never depends on which plugin answered first.

    Raises :class:`~ortcore.errors.OptionError` for a name declared twice, a ``before``/``after`` naming no pass, or
    a cycle (naming the passes in it).
    """
    by_name: dict[str, GraphPass] = {}
    for p in passes:
        if p.name in by_name:
            raise OptionError(
                f"graph pass name {p.name!r} is declared twice (plugins {by_name[p.name].plugin!r} and {p.plugin!r})"
            )
        by_name[p.name] = p
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for p in by_name.values():
        for other in (*p.before, *p.after):
            if other not in by_name:
                raise OptionError(
                    f"graph pass {p.name!r} (plugin {p.plugin!r}) orders itself against unknown pass {other!r}; "
                    f"known: {sorted(by_name)}"
                )
        sorter.add(p.name, *p.after)  # p runs after each of p.after
        for other in p.before:
            sorter.add(other, p.name)  # and before each of p.before
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        cycle = e.args[1]  # [a, b, ..., a]: each must run before the next
        described = " -> ".join(f"{n!r} (plugin {by_name[n].plugin!r})" for n in cycle)
        raise OptionError(
            f"graph passes order themselves in a cycle (before/after; each must run before the next): {described}"
        ) from None
    ordered: list[GraphPass] = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready())
        ordered.extend(by_name[name] for name in ready)
        sorter.done(*ready)
    return ordered
