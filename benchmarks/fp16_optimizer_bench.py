"""Overflow check + gradient norm, DeepSpeed's against FP16_Optimizer's, over GPT-2-shaped gradients.

``DS_ACCELERATOR=cpu python benchmarks/fp16_optimizer_bench.py [--layers 9] [--reps 10] [--dtype bf16]``

The gradients are those of GPT-2 small with ``--layers`` blocks (9: 103.2M values in 112 tensors), in ``--dtype``;
the ZeRO path also in fp32 for the BF16 optimizer's fp32 gradients. Each pair runs DeepSpeed's own code and the same
call after ``FP16_Optimizer``, in a shuffled order per repetition (both see the same machine load):

* ``ZeRO 1/2``: ``DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial`` + ``get_grad_norm_direct``, the two
  calls its ``step`` makes, on an instance holding only the attributes they read;
* ``FP16 unfused``: the overflow checker's ``has_overflow_serial`` + ``get_weight_norm``, as
  ``FP16_UnfusedOptimizer.step`` calls them;
* ``BF16``: ``get_global_norm_of_tensors`` + ``clip_tensors_by_global_norm`` on fp32 gradients, as
  ``BF16_Optimizer.step`` calls them (the clip factor is forced below 1 so the clipping runs).

Printed: median and fastest time of each, and the ratios original / wrapped of both (above 1: the wrapped is faster).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fused_adam_bench import gpt2_shapes  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def init_one_process_group() -> None:
    import deepspeed

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def zero_pair(grads: list[torch.Tensor]) -> tuple[Callable[[], object], Callable[[], object]]:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from ortcore_plugins.fp16_optimizer import FP16_Optimizer

    def instance() -> DeepSpeedZeroOptimizer:
        optimizer = object.__new__(DeepSpeedZeroOptimizer)
        optimizer.bit16_groups = [grads]
        optimizer.averaged_gradients = {0: grads}
        optimizer.dp_process_group = None
        optimizer.model_parallel_group = None
        optimizer.model_parallel_rank = 0
        optimizer.device = "cpu"
        return optimizer

    original, wrapped = instance(), FP16_Optimizer(instance())
    params = [torch.empty(0)] * len(grads)  # only their attributes are read

    def run(optimizer: DeepSpeedZeroOptimizer) -> Callable[[], object]:
        return lambda: (
            optimizer.has_overflow_partitioned_grads_serial(),
            optimizer.get_grad_norm_direct(grads, params),
        )

    return run(original), run(wrapped)


def unfused_pair(grads: list[torch.Tensor]) -> tuple[Callable[[], object], Callable[[], object]]:
    import deepspeed.runtime.fp16.unfused_optimizer as unfused
    from deepspeed.runtime.utils import CheckOverflow

    from ortcore_plugins import fp16_optimizer

    params = [torch.nn.Parameter(torch.zeros((), dtype=g.dtype).expand(g.shape)) for g in grads]  # no storage
    for p, g in zip(params, grads):
        p.grad = g
    original_checker, wrapped_checker = CheckOverflow([params]), CheckOverflow([params])
    holder = type("Holder", (), {})()
    holder.overflow_checker = wrapped_checker
    fp16_optimizer._patch_overflow_checker(holder)
    fast_norm = fp16_optimizer._weight_norm(unfused.get_weight_norm)
    return (
        lambda: (original_checker.check(), unfused.get_weight_norm(grads)),
        lambda: (wrapped_checker.check(), fast_norm(grads)),
    )


def bf16_pair(grads: list[torch.Tensor]) -> tuple[Callable[[], object], Callable[[], object]]:
    import deepspeed.runtime.bf16_optimizer as bf16

    from ortcore_plugins import fp16_optimizer

    fast_norm = fp16_optimizer._global_norm_of_tensors(bf16.get_global_norm_of_tensors)
    fast_clip = fp16_optimizer._clip_tensors_by_global_norm(bf16.clip_tensors_by_global_norm)

    def run(norm: Callable[..., torch.Tensor], clip: Callable[..., object]) -> Callable[[], object]:
        def norm_and_clip() -> object:
            total = norm(grads)
            return clip(grads, max_norm=total.item() * (1 - 1e-7), global_norm=total)  # a factor just below 1

        return norm_and_clip

    return run(bf16.get_global_norm_of_tensors, bf16.clip_tensors_by_global_norm), run(fast_norm, fast_clip)


def bench(layers: int, reps: int, dtype: torch.dtype, seed: int = 0) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    fp32 = [torch.randn(shape) * 1e-3 for shape in gpt2_shapes(layers)]
    low = [g.to(dtype) for g in fp32]
    pairs = {"ZeRO 1/2": zero_pair(low), "FP16 unfused": unfused_pair(low), "BF16 (fp32 grads)": bf16_pair(fp32)}
    variants = {}
    for name, (original, wrapped) in pairs.items():
        variants[f"{name} original"], variants[f"{name} wrapped"] = original, wrapped
    for run in variants.values():
        run()  # warm-up, not timed
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    init_one_process_group()
    values = sum(torch.Size(s).numel() for s in gpt2_shapes(args.layers))
    times = bench(args.layers, args.reps, DTYPES[args.dtype])
    print(f"{values / 1e6:.1f}M gradient values, {args.dtype}, torch {torch.__version__}, {args.reps} repetitions")
    print(f"| {'variant':<28} | median (ms) | ratio | fastest (ms) | ratio |")
    print(f"|{'-' * 30}|------------:|------:|-------------:|------:|")
    for name, samples in times.items():
        ratios = ["", ""]
        if name.endswith("wrapped"):
            original = times[name.replace("wrapped", "original")]
            ratios = [f"{f(original) / f(samples):.2f}" for f in (statistics.median, min)]
        median, fastest = statistics.median(samples) * 1e3, min(samples) * 1e3
        print(f"| {name:<28} | {median:11.0f} | {ratios[0]:>5} | {fastest:12.0f} | {ratios[1]:>5} |")


if __name__ == "__main__":
    main()
