"""``ortcore explain``: the explain plugin's command (light: no torch at import)."""

from __future__ import annotations

import argparse

from ortcore.api import hookimpl
from ortcore_plugins.services.example_models import MODELS


@hookimpl
def ortcore_commands(subparsers: argparse._SubParsersAction) -> None:
    _add_explain(subparsers)


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

    if spec in MODELS:
        from ortcore_plugins.services.example_models import BenchConfig, build_model, make_batches

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

    from ortcore.api import ORTModule

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
    print(
        f"{len(routed)} op kind(s) run on PyTorch's kernels inside the ORT graph" if routed else "every op runs in ORT"
    )
    return 0
