"""load_balancing_sampler: distributed samplers that give every rank about the same amount of work per step.

Offered under ``ortcore.utils.data`` through the ``ortcore_register`` hook::

    from ortcore.utils.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len, num_replicas=world, rank=rank)
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=batch_fn)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler)
    for epoch in range(epochs):
        batch_sampler.set_epoch(epoch)
        train(loader)

Each epoch, every rank computes the same plan from ``seed + epoch``:

1. the epoch's samples are those of ``torch.utils.data.DistributedSampler`` for the same seed and epoch (a random
   permutation, cut to a multiple of the world size with ``drop_last``, else padded by repeating its first samples);
2. they are sorted by complexity (within consecutive groups of ``group_size`` if given), after adding uniform noise
   of up to ``random_level`` times the complexity range;
3. the sorted list is cut into chunks of ``world_size`` neighbours (so of similar complexity); the ``k``-th sample
   of every rank comes from chunk ``k``, and the chunks' order is shuffled (kept when grouping: groups are already
   random, and their sorted runs keep similar samples next to each other for batching);
4. inside each chunk the most complex sample goes to the rank with the least total complexity so far, the next one
   to the next lightest rank, and so on.

Step 4 bounds the imbalance: after any number of chunks, two ranks' running totals differ by at most the largest
complexity spread inside one chunk, so by at most ``max(complexity) - min(complexity)``, however long the epoch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ortcore.api import hookimpl

NAME = "load_balancing_sampler"

# Read from the source by ortcore.utils.data when this plugin is disabled, to name it in the error.
DATA_UTILITIES = ("LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler")


def _integer(owner: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; expected an integer >= {minimum}")
    return int(value)


def _boolean(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; expected True or False")
    return value


def _world_and_rank(world_size: int | None, num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """The world size and rank given, or those of the initialized default process group."""
    owner = "LoadBalancingDistributedSampler"
    if world_size is not None and num_replicas is not None and world_size != num_replicas:
        raise ValueError(
            f"{owner}: world_size={world_size!r} and num_replicas={num_replicas!r} disagree; num_replicas is "
            "another name for world_size: give one of them (or the same value to both)"
        )
    size = world_size if world_size is not None else num_replicas
    if size is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            missing = " and ".join(
                name for name, value in (("world_size (num_replicas)", size), ("rank", rank)) if value is None
            )
            raise RuntimeError(
                f"{owner}: {missing} not given and torch.distributed is not initialized; pass world_size= (or "
                "num_replicas=) and rank=, or call torch.distributed.init_process_group() first"
            )
        size = dist.get_world_size() if size is None else size
        rank = dist.get_rank() if rank is None else rank
    size = _integer(owner, "world_size" if world_size is not None else "num_replicas", size, 1)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < size:
        raise ValueError(f"{owner}: rank={rank!r} is not allowed; expected an integer in [0, {size - 1}]")
    return size, int(rank)


class LoadBalancingDistributedSampler(Sampler[int]):
    """Each rank's share of a map-style data set, balanced by a per-sample complexity (sequence length, say).

    Covers the same samples as ``torch.utils.data.DistributedSampler`` with the same ``seed``, epoch and
    ``drop_last`` (the ranks' shares are disjoint except for the padding), but the ``k``-th samples of all ranks
    have similar complexities and every rank's running total stays within one chunk's spread of the others'
    (see the module docstring).

    Args:
        dataset: a map-style data set (``len(dataset)`` and ``dataset[i]``); its size must not change.
        complexity_fn: ``complexity_fn(dataset[i])`` is the cost of sample ``i``, a finite number >= 0 (its length,
            its token count). Called once per sample, on first use; the values are kept.
        world_size: number of ranks; by default that of the initialized ``torch.distributed`` group.
        rank: this process's rank in ``[0, world_size - 1]``; by default its rank in that group.
        shuffle: draw a new random order every epoch (from ``seed + epoch``); False: complexity order.
        group_size: sort by complexity only within consecutive groups of this many samples of the epoch's order
            (``None``: the whole epoch is one group). Keeps more randomness; with a multiple of ``world_size``, no
            chunk straddles two groups.
        seed: the shuffle's seed, the same on every rank.
        drop_last: drop ``len(dataset) % world_size`` samples (the last ones of the epoch's random order, or of the
            data set without ``shuffle``) so every rank gets ``len(dataset) // world_size``; False: repeat the
            first samples of the epoch's order until every rank gets ``ceil(len(dataset) / world_size)``.
        random_level: in ``[0, 1]``: noise of up to this fraction of the complexity range is added to each
            sample's complexity before sorting; 0 balances each step best, 1 makes the chunks nearly random.
        num_replicas: ``torch.utils.data.DistributedSampler``'s name for ``world_size``.

    Example::

        sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len, num_replicas=4, rank=rank, seed=0)
        loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=8)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            train(loader)
    """

    def __init__(
        self,
        dataset: Any,
        complexity_fn: Callable[[Any], float],
        world_size: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        group_size: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
        *,
        num_replicas: int | None = None,
    ) -> None:
        owner = type(self).__name__
        try:
            size = len(dataset)
        except TypeError:
            raise TypeError(
                f"{owner}: dataset {type(dataset).__name__} has no len(); expected a map-style data set"
            ) from None
        if not callable(complexity_fn):
            raise TypeError(f"{owner}: complexity_fn={complexity_fn!r} is not callable; expected f(sample) -> number")
        self.world_size, self.rank = _world_and_rank(world_size, num_replicas, rank)
        self.shuffle = _boolean(owner, "shuffle", shuffle)
        self.group_size = None if group_size is None else _integer(owner, "group_size", group_size, 1)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"{owner}: seed={seed!r} is not allowed; expected an integer")
        self.seed = int(seed)
        self.drop_last = _boolean(owner, "drop_last", drop_last)
        if isinstance(random_level, bool) or not isinstance(random_level, numbers.Real) or not 0 <= random_level <= 1:
            raise ValueError(f"{owner}: random_level={random_level!r} is not allowed; expected a number in [0, 1]")
        self.random_level = float(random_level)
        self.dataset = dataset
        self.complexity_fn = complexity_fn
        self.epoch = 0
        if self.drop_last:
            self.num_samples = size // self.world_size
        else:
            self.num_samples = math.ceil(size / self.world_size)
        self.total_size = self.num_samples * self.world_size
        self._complexities: np.ndarray | None = None
        self._plan: tuple[int, list[list[int]]] | None = None

    @property
    def num_replicas(self) -> int:
        """``world_size``, under ``torch.utils.data.DistributedSampler``'s name."""
        return self.world_size

    @property
    def complexities(self) -> np.ndarray:
        """``complexity_fn(dataset[i])`` for every ``i``, computed on first use (read-only float64 array)."""
        if self._complexities is None:
            values = np.empty(len(self.dataset), dtype=np.float64)
            for i in range(len(values)):
                value = self.complexity_fn(self.dataset[i])
                if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
                    value = value.item()  # (mask != 0).sum() and the like
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                    raise ValueError(
                        f"{type(self).__name__}: complexity_fn(dataset[{i}]) returned {value!r}; expected a finite "
                        "number >= 0"
                    )
                values[i] = value
            values.flags.writeable = False
            self._complexities = values
        return self._complexities

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order (call before iterating; the same epoch and seed give the same order)."""
        self.epoch = _integer(type(self).__name__, "epoch", epoch, 0)

    def rank_indices(self) -> list[list[int]]:
        """Every rank's sample indices for the current epoch, in order: ``rank_indices()[r]`` is what rank ``r``
        iterates. All ranks compute the same lists."""
        if self._plan is None or self._plan[0] != self.epoch:
            self._plan = (self.epoch, self._plan_epoch(self.epoch))
        return self._plan[1]

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_indices()[self.rank])

    def __len__(self) -> int:
        return self.num_samples

    def _plan_epoch(self, epoch: int) -> list[list[int]]:
        world, count = self.world_size, len(self.dataset)
        if self.num_samples == 0:
            return [[] for _ in range(world)]
        complexities = self.complexities
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        # The same draw and cut as torch's DistributedSampler, so both cover the same samples.
        order = torch.randperm(count, generator=generator).numpy() if self.shuffle else np.arange(count)
        if self.drop_last:
            order = order[: self.total_size]
        else:
            order = np.concatenate([order, np.resize(order, self.total_size - count)])
        keys = complexities[order]
        if self.random_level > 0:
            spread = float(complexities.max() - complexities.min())
            noise = torch.rand(len(order), generator=generator, dtype=torch.float64).numpy()
            keys = keys + noise * (self.random_level * spread)
        if self.group_size is None:
            ranking = np.argsort(keys, kind="stable")
        else:
            ranking = np.lexsort((keys, np.arange(len(order)) // self.group_size))
        chunks = order[ranking].reshape(self.num_samples, world)
        # Heaviest sample of each chunk first, by true complexity (the noise only decides the chunks).
        chunks = np.take_along_axis(chunks, np.argsort(-complexities[chunks], axis=1, kind="stable"), axis=1)
        if self.shuffle and self.group_size is None:
            chunks = chunks[torch.randperm(self.num_samples, generator=generator).numpy()]
        return self._balance(chunks, complexities[chunks]).T.tolist()

    @staticmethod
    def _balance(chunks: np.ndarray, costs: np.ndarray) -> np.ndarray:
        """``chunks`` (one row per chunk, heaviest first) rearranged so that column ``r`` is rank ``r``'s share:
        each chunk's heaviest sample goes to the lightest rank so far, and so on down."""
        count, world = chunks.shape
        if world == 1:
            return chunks
        flat_costs = costs.ravel().tolist()  # flat lists: Python loops over numpy rows are slow
        ranks, loads = list(range(world)), [0.0] * world
        owners: list[int] = []
        for start in range(0, len(flat_costs), world):
            ranks.sort(key=loads.__getitem__)
            owners += ranks
            for cost, rank in zip(flat_costs[start : start + world], ranks):
                loads[rank] += cost
        shares = np.empty_like(chunks)
        shares[np.arange(count)[:, None], np.asarray(owners).reshape(count, world)] = chunks
        return shares


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Batches of a ``LoadBalancingDistributedSampler``'s share, the same number on every rank.

    ``batch_fn(indices) -> list of batches`` groups one rank's indices (in the sampler's order) into batches of
    dataset indices; it is called for every rank's share, so all ranks know each other's batch counts. With
    ``drop_last`` every rank keeps only as many batches as the rank with fewest; otherwise ranks with fewer batches
    repeat their first ones until all have as many as the rank with most (DDP needs the same number of steps on
    every rank).

    Args:
        sampler: the ``LoadBalancingDistributedSampler`` whose share is batched.
        batch_fn: ``batch_fn(list[int]) -> list[list[int]]``; every batch non-empty and made of the indices given.
        drop_last: drop the batches beyond the smallest count instead of repeating up to the largest.

    Example::

        def batch_fn(indices):
            return [indices[i : i + 8] for i in range(0, len(indices), 8)]

        batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=batch_fn)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler)
        for epoch in range(epochs):
            batch_sampler.set_epoch(epoch)
            train(loader)
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], Sequence[Sequence[int]]],
        drop_last: bool = False,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(f"{owner}: sampler={sampler!r} is not allowed; expected a LoadBalancingDistributedSampler")
        if not callable(batch_fn):
            raise TypeError(f"{owner}: batch_fn={batch_fn!r} is not callable; expected f(indices) -> list of batches")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = _boolean(owner, "drop_last", drop_last)
        self._batches: tuple[int, list[list[list[int]]]] | None = None

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    @property
    def rank(self) -> int:
        return self.sampler.rank

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order: sets the sampler's epoch."""
        self.sampler.set_epoch(epoch)

    def rank_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch, after dropping or repeating: ``rank_batches()[r]`` is what
        rank ``r`` iterates."""
        if self._batches is None or self._batches[0] != self.sampler.epoch:
            self._batches = (self.sampler.epoch, self._batch_epoch())
        return self._batches[1]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.rank_batches()[self.rank])

    def __len__(self) -> int:
        return len(self.rank_batches()[self.rank])

    def _batch_epoch(self) -> list[list[list[int]]]:
        owner = type(self).__name__
        every_rank = []
        for rank, indices in enumerate(self.sampler.rank_indices()):
            given = set(indices)
            batches = [[int(i) for i in batch] for batch in self.batch_fn(list(indices))]
            for number, batch in enumerate(batches):
                if not batch:
                    raise ValueError(
                        f"{owner}: batch_fn returned an empty batch (batch {number} of rank {rank}); every batch "
                        "must hold at least one index"
                    )
                stray = next((i for i in batch if i not in given), None)
                if stray is not None:
                    raise ValueError(
                        f"{owner}: batch_fn returned index {stray} for rank {rank}, which is not among the indices "
                        "it was given; batch_fn must group the dataset indices it receives (not their positions)"
                    )
            every_rank.append(batches)
        counts = [len(batches) for batches in every_rank]
        steps = min(counts) if self.drop_last else max(counts)
        if steps and not min(counts):
            empty = counts.index(0)
            raise ValueError(
                f"{owner}: batch_fn returned no batches for rank {empty} while rank {counts.index(steps)} has "
                f"{steps}; it has nothing to repeat: batch_fn must return at least one batch for a non-empty share"
            )
        return [[batches[i % len(batches)] for i in range(steps)] for batches in every_rank]


@hookimpl
def ortcore_register(register: Any) -> None:
    register.data_utility("LoadBalancingDistributedSampler", LoadBalancingDistributedSampler)
    register.data_utility("LoadBalancingDistributedBatchSampler", LoadBalancingDistributedBatchSampler)
