"""compute_optimizer: switch ONNX Runtime's compute optimizer on the gradient graph ORT builds.

The compute optimizer is a group of ORT's pre-gradient graph transformers that compute less: ``UpStreamGather``
and ``UpStreamReshape`` move slicing and reshaping ops towards the graph inputs so the ops before them handle fewer
elements, and ``InsertGatherBeforeSceLoss`` drops padded labels before the loss (driven by the
``sparse_optimizer`` plugin). ORT compiles ``PaddingElimination`` and ``Conv1dReplacement`` into the same group
only in CUDA/ROCm builds.

ORT's own default (a default-constructed ``TrainingGraphTransformerConfiguration``) has the compute optimizer
**off**; this plugin sets it explicitly either way, so:

- plugin loaded, ``enable = true`` (the default): on;
- plugin loaded, ``enable = false`` or ``ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0``: off, set by this plugin;
- plugin disabled (``[plugins] disable``) or not installed: off, ORT's default; the label sparsity of
  ``sparse_optimizer`` is then off too, as it needs the compute optimizer.

ORT 1.19.2's ``UpStreamReshape`` moves a ``Reshape`` that reads a graph output above the op producing it without
keeping the output's shape: with static sizes, a causal LM's ``logits`` (``[B, S, V]``, also reshaped to
``[B*S, V]`` for the loss) became a ``[B*S, V]`` graph output, and the backward failed adding the user's ``[B, S, V]``
gradient to it. The plugin's graph pass ``shield_graph_outputs`` gives each graph output that the graph also reads an
``Identity`` of its own, so the transformers see a consumer to keep the shape for; ORT drops the ``Identity`` when the
session is created (no copy at run time).

When the gradient build or the first run of a graph fails inside one of these transformers (ORT 1.19.2's
``UpStreamGather`` throws on some symbolic dimensions: ``upstream_gather_actors.cc``, ``CreateNewShapeWithUpdatedDim``),
the plugin offers the repair that switches it off for that model (``ortcore_repairs``, the smallest repair there is).

Options (``[plugins.compute_optimizer]`` in ortcore.toml, or the environment; the environment wins)::

    [plugins.compute_optimizer]
    enable = true   # env ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=1/0
"""

from __future__ import annotations

from typing import Any

import attrs
import onnx

from ortcore.api import Config, Failure, GraphPass, PassContext, Repair, hookimpl, option, parse_bool

NAME = "compute_optimizer"


@attrs.frozen
class ComputeOptimizerOptions:
    """Options of the ``compute_optimizer`` plugin."""

    enable: bool = option(
        True,
        parse_bool,
        "run ORT's compute optimizer (UpStreamGather, UpStreamReshape, InsertGatherBeforeSceLoss)",
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER",
    )


@hookimpl
def ortcore_options_class() -> type:
    return ComputeOptimizerOptions


@hookimpl
def ortcore_graph_transformer_config(config: Config, transformer_config: Any) -> None:
    # Set in both directions: the configuration the core passes is default-constructed, and a later ORT could change
    # its default; an explicit value keeps "enable = false" meaning off whatever ORT's default becomes.
    transformer_config.enable_compute_optimizer = config.plugin_options(NAME).enable


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    options = config.plugin_options(NAME)
    return [GraphPass("shield_graph_outputs", run=shield_graph_outputs)] if options is not None and options.enable else []


def shield_graph_outputs(model: onnx.ModelProto, ctx: PassContext | None = None) -> None:
    """Each graph output that nodes of the graph also read is produced by an ``Identity`` of its own; the graph's
    nodes read the value before it (see the module's docstring)."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input}
    made = {name for node in graph.node for name in node.output}
    # dict.fromkeys: a value the model returns twice (``return y, ..., y``) is one graph output name, shielded once.
    shielded = list(dict.fromkeys(o.name for o in graph.output if o.name in read and o.name in made))
    if not shielded:
        return
    renamed = {name: f"{name}_before_output" for name in shielded}
    for node in graph.node:
        for names in (node.input, node.output):
            for k, name in enumerate(names):
                if name in renamed:
                    names[k] = renamed[name]
    # The renamed value keeps the output's type: ORT cannot infer one for some producers (an ATen node).
    for value in [*graph.value_info]:
        if value.name in renamed:
            value.name = renamed[value.name]
    typed = {v.name for v in graph.value_info}
    for output in graph.output:
        if output.name in renamed and renamed[output.name] not in typed:
            copy = graph.value_info.add()
            copy.CopyFrom(output)
            copy.name = renamed[output.name]
    graph.node.extend(
        onnx.helper.make_node("Identity", [renamed[name]], [name], name=f"{name}_output") for name in shielded
    )


# Where ORT's compute-optimizer transformers live and what they throw: a failure naming one of these is theirs.
_OWN_FAILURES = (
    "upstream_gather",
    "upstream_reshape",
    "upstream_transformer",
    "compute_optimizer",
    "CreateNewShapeWithUpdatedDim",
    "InsertGatherBeforeSceLoss",
    "UpStreamGather",
    "UpStreamReshape",
)


@hookimpl
def ortcore_repairs(config: Config, failure: Failure) -> list[Repair] | None:
    """A build or first run that failed inside the compute optimizer: switch it off for this model."""
    options = config.plugin_options(NAME)
    if options is None or not options.enable or failure.stage not in ("build", "run"):
        return None
    if not any(marker in failure.message for marker in _OWN_FAILURES):
        return None
    return [Repair("compute optimizer off", plugin=NAME, options={"enable": False}, kind="switch")]
