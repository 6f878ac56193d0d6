"""Padded tokens of the slowest rank per step, torch's DistributedSampler against the load-balancing samplers:
``python benchmarks/load_balancing_sampler_bench.py [--samples 20000] [--batch 16] [--world 2 4 8] [--json]``.

The data set is ``--samples`` sequence lengths drawn from a skewed distribution (``--distribution``): ``lognormal``
(median 128 tokens, sigma 1, clipped to [4, 2048]) or ``zipf`` (exponent 1.5, clipped to [4, 2048]). The complexity
of a sample is its length. Each rank groups its share, in the sampler's order, into batches of ``--batch``
consecutive samples, and a batch costs ``batch size * its longest sample`` tokens (padded to its longest sample). In
synchronous data-parallel training a step lasts as long as its slowest rank, so the figure of merit is the slowest
rank's padded tokens per step, averaged over the steps of ``--epochs`` epochs. Samplers:

* ``torch``: ``torch.utils.data.DistributedSampler(shuffle=True)``;
* ``balanced``: ``LoadBalancingDistributedSampler`` with its defaults (batches by ``LoadBalancingDistributedBatchSampler``);
* ``balanced, grouped``: the same with ``group_size = 64 * batch * world`` (sorted runs: batches of similar lengths).

Printed per world size and sampler: the slowest rank's padded tokens per step and its ratio to torch's, the useful
share of the work (real tokens over ``world * slowest rank's padded tokens``), the straggler factor (slowest rank
over the mean rank, per step, averaged) and the spread of the ranks' total real tokens ((max - min) / mean).
Pure Python on the CPU; deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import numpy as np
import torch

from ortcore_plugins.load_balancing_sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

DISTRIBUTIONS = ("lognormal", "zipf")
SAMPLERS = ("torch", "balanced", "balanced, grouped")


def sequence_lengths(samples: int, distribution: str, seed: int = 0) -> list[int]:
    """``samples`` skewed sequence lengths in [4, 2048]."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution={distribution!r} is not allowed; allowed: {', '.join(DISTRIBUTIONS)}")
    rng = np.random.default_rng(seed)
    if distribution == "lognormal":
        values = np.rint(rng.lognormal(mean=np.log(128), sigma=1.0, size=samples))
    else:
        values = rng.zipf(1.5, size=samples) * 4
    return np.clip(values, 4, 2048).astype(int).tolist()


def fixed_batches(size: int) -> Callable[[list[int]], list[list[int]]]:
    """A ``batch_fn``: consecutive runs of ``size`` indices."""

    def batch_fn(indices: list[int]) -> list[list[int]]:
        return [indices[i : i + size] for i in range(0, len(indices), size)]

    return batch_fn


def rank_batches(
    sampler: str, lengths: list[int], world: int, batch: int, epoch: int, seed: int
) -> list[list[list[int]]]:
    """Every rank's batches of one epoch under ``sampler``."""
    if sampler == "torch":
        every_rank = []
        for rank in range(world):
            torch_sampler = torch.utils.data.DistributedSampler(lengths, num_replicas=world, rank=rank, seed=seed)
            torch_sampler.set_epoch(epoch)
            every_rank.append(fixed_batches(batch)(list(torch_sampler)))
        return every_rank
    group_size = 64 * batch * world if sampler == "balanced, grouped" else None
    balanced = LoadBalancingDistributedSampler(
        lengths, complexity_fn=float, num_replicas=world, rank=0, seed=seed, group_size=group_size
    )
    batch_sampler = LoadBalancingDistributedBatchSampler(balanced, batch_fn=fixed_batches(batch))
    batch_sampler.set_epoch(epoch)
    return batch_sampler.rank_batches()


def measure(lengths: list[int], world: int, batch: int, epochs: int, seed: int) -> dict[str, dict[str, float]]:
    """Per sampler: ``slowest`` (the slowest rank's padded tokens per step), ``useful`` (real tokens over
    ``world * slowest``), ``straggler`` (slowest over mean rank per step) and ``spread`` ((max - min) / mean of the
    ranks' total real tokens), over ``epochs`` epochs."""
    results = {}
    for sampler in SAMPLERS:
        slowest, straggler, spreads, real = [], [], [], 0
        for epoch in range(epochs):
            every_rank = rank_batches(sampler, lengths, world, batch, epoch, seed)
            totals = [sum(lengths[i] for b in batches for i in b) for batches in every_rank]
            spreads.append((max(totals) - min(totals)) / statistics.mean(totals))
            real += sum(totals)
            for step in zip(*every_rank):
                padded = [len(b) * max(lengths[i] for i in b) for b in step]
                slowest.append(max(padded))
                straggler.append(max(padded) / statistics.mean(padded))
        results[sampler] = {
            "slowest": statistics.mean(slowest),
            "useful": real / (world * sum(slowest)),
            "straggler": statistics.mean(straggler),
            "spread": max(spreads),
        }
    for values in results.values():
        values["ratio"] = values["slowest"] / results["torch"]["slowest"]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20000, help="data set size")
    parser.add_argument("--batch", type=int, default=16, help="samples per batch on each rank")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8], help="world sizes")
    parser.add_argument("--epochs", type=int, default=2, help="epochs measured per sampler")
    parser.add_argument("--distribution", choices=DISTRIBUTIONS, default="lognormal", help="sequence lengths")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and of the samplers")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch < 1 or args.epochs < 1 or min(args.world) < 1:
        parser.error(
            f"--samples={args.samples} --batch={args.batch} --epochs={args.epochs} --world={args.world}: "
            "expected every value >= 1"
        )
    lengths = sequence_lengths(args.samples, args.distribution, args.seed)
    results = {world: measure(lengths, world, args.batch, args.epochs, args.seed) for world in args.world}
    if args.json:
        print(json.dumps({str(world): values for world, values in results.items()}, indent=2))
        return 0
    print(
        f"{args.samples} {args.distribution} lengths (median {statistics.median(lengths):.0f}, mean "
        f"{statistics.mean(lengths):.0f}, max {max(lengths)}), batches of {args.batch}, {args.epochs} epochs"
    )
    print("| world | sampler           | slowest rank (padded tokens/step) | ratio | useful | straggler |  spread |")
    print("|------:|-------------------|----------------------------------:|------:|-------:|----------:|--------:|")
    for world, by_sampler in results.items():
        for sampler, v in by_sampler.items():
            print(
                f"| {world:>5} | {sampler:<17} | {v['slowest']:>33.0f} | {v['ratio']:>5.2f} | {v['useful']:>6.1%} "
                f"| {v['straggler']:>9.3f} | {v['spread']:>7.3%} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
