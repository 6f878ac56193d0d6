"""One optimizer step over GPT-2-shaped parameters: ``python benchmarks/fused_adam_bench.py [--layers 9] [--reps 5]``.

The parameters are those of GPT-2 small with ``--layers`` blocks (9 blocks: about 103M fp32 values in 112 tensors of
the real shapes: token and position embeddings, layer norms, attention and MLP weights and biases). They and their
gradients are shared by every variant; each variant keeps its own moments. Variants, timed one step each in a
shuffled order per repetition (all see the same machine load), after one untimed step that allocates the state:

* ``FusedAdam`` (``AdamWMode.ADAMW_TORCH``, and ``ADAMW_TRANSFORMERS``, which takes the ``torch._foreach_*`` path);
* ``torch.optim.AdamW`` with ``foreach=False``, ``foreach=True`` and ``fused=True``.

Printed: the median and the fastest step time of each, and their ratios to the fastest torch variant.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from ortcore_plugins.fused_adam import AdamWMode, FusedAdam

HIDDEN, VOCAB, POSITIONS = 768, 50257, 1024


def gpt2_shapes(layers: int) -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small with ``layers`` blocks."""
    shapes: list[tuple[int, ...]] = [(VOCAB, HIDDEN), (POSITIONS, HIDDEN)]
    block = [
        (HIDDEN,), (HIDDEN,),  # ln_1
        (HIDDEN, 3 * HIDDEN), (3 * HIDDEN,),  # attn.c_attn
        (HIDDEN, HIDDEN), (HIDDEN,),  # attn.c_proj
        (HIDDEN,), (HIDDEN,),  # ln_2
        (HIDDEN, 4 * HIDDEN), (4 * HIDDEN,),  # mlp.c_fc
        (4 * HIDDEN, HIDDEN), (HIDDEN,),  # mlp.c_proj
    ]  # fmt: skip
    shapes += block * layers
    shapes += [(HIDDEN,), (HIDDEN,)]  # ln_f
    return shapes


def make_variants(params: list[torch.Tensor], lr: float, weight_decay: float) -> dict[str, torch.optim.Optimizer]:
    return {
        "FusedAdam ADAMW_TORCH": FusedAdam(params, lr=lr, eps=1e-8, weight_decay=weight_decay,
                                           adam_w_mode=AdamWMode.ADAMW_TORCH),
        "FusedAdam ADAMW_TRANSFORMERS": FusedAdam(params, lr=lr, eps=1e-8, weight_decay=weight_decay,
                                                  adam_w_mode=AdamWMode.ADAMW_TRANSFORMERS),
        "torch AdamW foreach=False": torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False),
        "torch AdamW foreach=True": torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True),
        "torch AdamW fused=True": torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True),
    }  # fmt: skip


def time_once(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def bench(layers: int = 9, reps: int = 5, seed: int = 0) -> dict[str, list[float]]:
    """Seconds per step of each variant, ``reps`` interleaved repetitions."""
    torch.manual_seed(seed)
    params = [torch.randn(shape) * 0.02 for shape in gpt2_shapes(layers)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    variants = make_variants(params, lr=1e-4, weight_decay=0.01)
    for optimizer in variants.values():
        optimizer.step()  # allocates the moments: not timed
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            times[name].append(time_once(variants[name].step))
    return times


def summarize(times: dict[str, list[float]]) -> list[tuple[str, str, str, str, str]]:
    """``(variant, median ms, its ratio, fastest ms, its ratio)`` rows; ratios are to the fastest torch variant (by
    median, and by fastest step: steadier on a busy machine)."""
    rows = []
    best = {}
    for statistic in (statistics.median, min):
        values = {name: statistic(t) for name, t in times.items()}
        best[statistic] = (values, min(v for name, v in values.items() if name.startswith("torch")))
    for name in times:
        cells = [name]
        for values, fastest_torch in best.values():
            cells += [f"{values[name] * 1e3:.0f}", f"{values[name] / fastest_torch:.2f}"]
        rows.append(tuple(cells))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=9, help="GPT-2 blocks (9: about 103M parameters)")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.layers < 0 or args.reps < 1:
        parser.error(f"--layers={args.layers} and --reps={args.reps}: expected layers >= 0 and reps >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    count = sum(torch.Size(s).numel() for s in gpt2_shapes(args.layers))
    tensors = len(gpt2_shapes(args.layers))
    print(f"{count / 1e6:.1f}M fp32 parameters in {tensors} tensors, {torch.get_num_threads()} threads, "
          f"{args.reps} interleaved steps per variant; torch {torch.__version__}")  # fmt: skip
    rows = summarize(bench(args.layers, args.reps))
    print(f"| {'variant':<30} | median (ms) | ratio | fastest (ms) | ratio |")
    print(f"|{'-' * 32}|------------:|------:|-------------:|------:|")
    for name, median, median_ratio, fastest, fastest_ratio in rows:
        print(f"| {name:<30} | {median:>11} | {median_ratio:>5} | {fastest:>12} | {fastest_ratio:>5} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
