"""random_seed: ONNX Runtime's random ops seeded from torch's generator, so ``torch.manual_seed`` repeats a run.

ORT's ``Dropout`` (and its fused forms, ``RandomNormal``, ...) draw from ORT's own generator, which
``torch.manual_seed`` does not touch: two identical ORTModule runs of a model with dropout gave different losses
(a tiny GPT-2 with dropout 0.1: 6.900605 and 6.895661 at step 1), while eager runs are bit-identical. Before each
call of a graph that holds a random op, this plugin draws one 63-bit number from torch's default generator and
seeds ORT's generator with it (``onnxruntime.capi._pybind_state.set_seed``). So:

- the same ``torch.manual_seed`` gives the same run, step for step;
- saving and restoring torch's generator state (``torch.get_rng_state()`` / ``set_rng_state``, which checkpointing
  code does) resumes the same random stream;
- graphs without random ops draw nothing: torch's stream is then exactly eager's.

What differs from eager PyTorch: the masks themselves (ORT's Philox generator is not torch's), and torch's generator
advances by one draw per call of such a graph where eager's dropout advances it by its masks' draws, so random
numbers the training script draws afterwards (data shuffling with the global generator, say) differ from an eager
run's, while being just as reproducible. Ops routed to PyTorch's kernels (ATen nodes) draw from torch's generator
themselves.

Options (``[plugins.random_seed]`` in ortcore.toml, or the environment; the environment wins)::

    [plugins.random_seed]
    enable = true   # env ORTCORE_SEED_FROM_TORCH=1/0
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch
from onnxruntime.capi import _pybind_state as C

from ortcore.api import Config, RuntimeInspector, hookimpl, option, parse_bool

NAME = "random_seed"

#: ONNX and ORT contrib op types that draw from ORT's generator.
RANDOM_OPS = frozenset(
    {
        "Dropout",
        "BitmaskDropout",
        "BiasDropout",
        "BitmaskBiasDropout",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)


@attrs.frozen
class RandomSeedOptions:
    """Options of the ``random_seed`` plugin."""

    enable: bool = option(
        True, parse_bool, "seed ONNX Runtime's random ops from torch's generator at each call", "ORTCORE_SEED_FROM_TORCH"
    )


@hookimpl
def ortcore_options_class() -> type:
    return RandomSeedOptions


@hookimpl
def ortcore_runtime_inspectors(config: Config, module: torch.nn.Module) -> list[Any]:
    options = config.plugin_options(NAME)
    return [SeedFromTorch()] if options is not None and options.enable else []


def has_random_ops(model: Any) -> bool:
    """Does the ONNX model (or a graph of a session) hold an op that draws from ORT's generator?"""
    graph = getattr(model, "graph", None)
    return graph is not None and any(node.op_type in RANDOM_OPS for node in graph.node)


def seed_from_torch() -> int:
    """One number from torch's default generator, ORT's seed for the coming call."""
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    C.set_seed(seed)
    return seed


class SeedFromTorch(RuntimeInspector):
    """Before each call of a graph with random ops, ORT's generator is seeded from torch's."""

    def __init__(self) -> None:
        self.random: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def pre_forward(self, step: int, inputs: Any) -> None:
        session = inputs.session
        if session is None:
            return
        random = self.random.get(session)
        if random is None:
            random = self.random[session] = has_random_ops(getattr(session, "model", None))
        if random:
            seed_from_torch()
