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

Options (``[plugins.compute_optimizer]`` in ortcore.toml, or the environment; the environment wins)::

    [plugins.compute_optimizer]
    enable = true   # env ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=1/0
"""

from __future__ import annotations

from typing import Any

import attrs

from ortcore.config import Config, option
from ortcore.hookspecs import hookimpl
from ortcore.options import parse_bool

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
