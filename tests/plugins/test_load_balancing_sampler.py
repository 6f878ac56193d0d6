"""load_balancing_sampler: the ranks' shares are disjoint and cover the samples torch's DistributedSampler covers,
every rank's total complexity stays within the stated bound of the others', the order follows seed and epoch, both
samplers drive a DataLoader, bad arguments are refused by name, and ``ortcore.utils.data`` offers the samplers only
when the plugin is enabled.

The stated bound (docs/plugins/load_balancing_sampler.md): after any number of chunks (steps, for batches of
consecutive samples), two ranks' running totals differ by at most S, the largest complexity spread inside one chunk
(S <= max - min complexity); so every rank's total is within S of the mean, and two ranks' totals over one batch
differ by at most 2 S. Measured here on lognormal and Zipf lengths, where torch's DistributedSampler is compared.
"""

from __future__ import annotations

import collections
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ortcore.utils.data as data
import ortcore_plugins.load_balancing_sampler as plugin
from ortcore.config import Config
from ortcore.contributed import declared_names
from ortcore.host import PluginHost, set_host
from ortcore_plugins.load_balancing_sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "load_balancing_sampler_bench.py"


def lognormal_lengths(count: int = 10_001, seed: int = 0) -> list[int]:
    """Skewed sequence lengths: median 128, sigma 1, clipped to [4, 2048] (the benchmark's distribution)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(128), 1.0, count)), 4, 2048).astype(int).tolist()


def zipf_lengths(count: int = 10_001, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.zipf(1.5, count) * 4, 4, 2048).astype(int).tolist()


def identity(sample: int) -> int:
    return sample


def sampler(dataset, world: int, rank: int = 0, **kwargs) -> LoadBalancingDistributedSampler:
    return LoadBalancingDistributedSampler(dataset, complexity_fn=identity, num_replicas=world, rank=rank, **kwargs)


def shares(dataset, world: int, **kwargs) -> list[list[int]]:
    """What each rank iterates, each rank's sampler built on its own as in a real job."""
    return [list(sampler(dataset, world, rank, **kwargs)) for rank in range(world)]


def torch_shares(dataset, world: int, epoch: int = 0, **kwargs) -> list[list[int]]:
    result = []
    for rank in range(world):
        reference = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, **kwargs)
        reference.set_epoch(epoch)
        result.append(list(reference))
    return result


def batches_of(size: int):
    def batch_fn(indices: list[int]) -> list[list[int]]:
        return [indices[i : i + size] for i in range(0, len(indices), size)]

    return batch_fn


def chunk_spread(lengths: list[int], every_rank: list[list[int]]) -> int:
    """S: the largest complexity spread among the k-th samples of all ranks (one chunk)."""
    return max(max(lengths[i] for i in chunk) - min(lengths[i] for i in chunk) for chunk in zip(*every_rank))


class Sequences(torch.utils.data.Dataset):
    def __init__(self, lengths: list[int]):
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.lengths[index],), index)


def pad(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-1)


# -- coverage ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("count", [64, 101])
def test_shares_are_disjoint_and_cover_the_data_set_padding_with_repeats(world, count):
    lengths = lognormal_lengths(count)
    every_rank = shares(lengths, world)
    assert all(len(share) == math.ceil(count / world) for share in every_rank)
    seen = collections.Counter(i for share in every_rank for i in share)
    assert set(seen) == set(range(count))
    repeated = sum(n - 1 for n in seen.values())
    assert repeated == math.ceil(count / world) * world - count  # the padding, and nothing else twice
    assert all(isinstance(i, int) for share in every_rank for i in share)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_drop_last_drops_the_remainder_and_shares_stay_disjoint(world):
    count = 101
    every_rank = shares(lognormal_lengths(count), world, drop_last=True)
    assert all(len(share) == count // world for share in every_rank)
    covered = [i for share in every_rank for i in share]
    assert len(covered) == len(set(covered)) == count - count % world


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("epoch", [0, 3])
def test_covers_the_same_samples_as_torch_distributed_sampler(shuffle, drop_last, epoch):
    lengths = lognormal_lengths(103)
    for world in (2, 4, 8):
        ours = [sampler(lengths, world, rank, shuffle=shuffle, drop_last=drop_last, seed=7) for rank in range(world)]
        for s in ours:
            s.set_epoch(epoch)
        reference = torch_shares(lengths, world, epoch, shuffle=shuffle, drop_last=drop_last, seed=7)
        assert collections.Counter(i for s in ours for i in s) == collections.Counter(
            i for share in reference for i in share
        )
        assert [len(s) for s in ours] == [len(share) for share in reference]


def test_fewer_samples_than_ranks_or_none():
    ours, reference = shares([5, 1, 3], 8), torch_shares([5, 1, 3], 8)
    assert [len(share) for share in ours] == [len(share) for share in reference] == [1] * 8
    assert collections.Counter(i for share in ours for i in share) == collections.Counter(
        i for share in reference for i in share
    )
    assert shares([5, 1, 3], 8, drop_last=True) == [[]] * 8
    assert shares([], 2) == [[], []]


# -- balance -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths_of", [lognormal_lengths, zipf_lengths], ids=["lognormal", "zipf"])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("options", [{}, {"group_size": 512}, {"random_level": 0.5}, {"shuffle": False}])
def test_rank_totals_stay_within_one_chunk_spread_of_each_other(lengths_of, world, options):
    lengths = lengths_of()
    every_rank = sampler(lengths, world, **options).rank_indices()
    spread = chunk_spread(lengths, every_rank)
    assert spread <= max(lengths) - min(lengths)
    running = np.cumsum([[lengths[i] for i in share] for share in every_rank], axis=1)
    assert (running.max(axis=0) - running.min(axis=0)).max() <= spread  # after every chunk, not only at the end
    totals = running[:, -1]
    assert totals.max() / totals.mean() <= 1 + spread / totals.mean()


@pytest.mark.parametrize("lengths_of", [lognormal_lengths, zipf_lengths], ids=["lognormal", "zipf"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_rank_totals_within_a_thousandth_of_the_mean_where_torch_is_off_by_percents(lengths_of, world):
    lengths = lengths_of()
    for epoch in range(3):
        s = sampler(lengths, world)
        s.set_epoch(epoch)
        totals = [sum(lengths[i] for i in share) for share in s.rank_indices()]
        reference = [sum(lengths[i] for i in share) for share in torch_shares(lengths, world, epoch)]
        assert max(totals) / np.mean(totals) <= 1.001
        assert max(totals) / np.mean(totals) < max(reference) / np.mean(reference)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_each_step_costs_about_the_same_on_every_rank(world):
    lengths, size = lognormal_lengths(), 16
    s = sampler(lengths, world)
    batch_sampler = LoadBalancingDistributedBatchSampler(s, batch_fn=batches_of(size))
    spread = chunk_spread(lengths, s.rank_indices())
    ours = [[sum(lengths[i] for i in batch) for batch in step] for step in zip(*batch_sampler.rank_batches())]
    assert max(max(step) - min(step) for step in ours) <= 2 * spread
    reference = [
        [sum(lengths[i] for i in batch) for batch in step]
        for step in zip(*(batches_of(size)(share) for share in torch_shares(lengths, world)))
    ]
    ours_straggle = np.mean([max(step) / np.mean(step) for step in ours])
    torch_straggle = np.mean([max(step) / np.mean(step) for step in reference])
    assert ours_straggle < 1.05 < torch_straggle


def test_random_level_trades_step_balance_for_randomness():
    lengths = lognormal_lengths()

    def step_imbalance(level: float) -> float:
        every_rank = sampler(lengths, 4, random_level=level).rank_indices()
        return np.mean([max(lengths[i] for i in chunk) - min(lengths[i] for i in chunk) for chunk in zip(*every_rank)])

    assert step_imbalance(0.0) < step_imbalance(0.1) < step_imbalance(1.0)


def test_without_shuffle_every_share_is_in_increasing_complexity():
    lengths = lognormal_lengths(1000)
    for share in shares(lengths, 4, shuffle=False):
        assert [lengths[i] for i in share] == sorted(lengths[i] for i in share)


def test_groups_are_sorted_runs_of_random_members():
    lengths, world, group = lognormal_lengths(1024), 4, 128
    s = sampler(lengths, world, group_size=group)
    run = group // world
    first = s.rank_indices()
    for share in first:
        for start in range(0, len(share), run):
            values = [lengths[i] for i in share[start : start + run]]
            assert values == sorted(values)
    s.set_epoch(1)
    assert set(first[0][:run]) != set(s.rank_indices()[0][:run])


# -- order ---------------------------------------------------------------------------------------------------------


def test_same_seed_and_epoch_give_the_same_order_and_other_epochs_another():
    lengths = lognormal_lengths(500)
    a, b = sampler(lengths, 4, rank=1, seed=3), sampler(lengths, 4, rank=1, seed=3)
    first = list(a)
    assert list(b) == first
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first
    a.set_epoch(0)
    assert list(a) == first
    assert list(sampler(lengths, 4, rank=1, seed=4)) != first


def test_separate_processes_compute_the_same_plan():
    code = (
        "import json, sys, numpy as np\n"
        "from ortcore_plugins.load_balancing_sampler import LoadBalancingDistributedSampler\n"
        "lengths = np.random.default_rng(0).lognormal(5, 1, 999).round().tolist()\n"
        "s = LoadBalancingDistributedSampler(lengths, float, num_replicas=2, rank=int(sys.argv[1]), group_size=64)\n"
        "s.set_epoch(5)\n"
        "print(json.dumps(list(s)))\n"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": str(rank + 1)},
        )
        for rank in range(2)
    ]
    every_rank = [json.loads(run.communicate(timeout=120)[0]) for run in runs]
    lengths = np.random.default_rng(0).lognormal(5, 1, 999).round().tolist()
    in_process = sampler(lengths, 2, group_size=64)
    in_process.set_epoch(5)
    assert every_rank == in_process.rank_indices()


def test_complexity_fn_is_called_once_per_sample():
    calls = collections.Counter()

    def counting(sample: int) -> int:
        calls[sample] += 1
        return sample

    s = LoadBalancingDistributedSampler(list(range(100)), complexity_fn=counting, world_size=2, rank=0)
    for epoch in range(3):
        s.set_epoch(epoch)
        list(s)
    assert calls == collections.Counter(range(100))


def test_complexity_fn_may_return_a_one_element_tensor():
    dataset = Sequences(lognormal_lengths(40))
    by_tensor = LoadBalancingDistributedSampler(dataset, lambda x: (x >= 0).sum(), world_size=2, rank=0)
    by_len = LoadBalancingDistributedSampler(dataset, len, world_size=2, rank=0)
    assert list(by_tensor) == list(by_len)
    assert by_tensor.complexities.tolist() == [float(n) for n in dataset.lengths]


# -- DataLoader ----------------------------------------------------------------------------------------------------


def test_dataloader_with_the_batch_sampler_yields_each_ranks_batches():
    dataset = Sequences(lognormal_lengths(203))
    seen = []
    for rank in range(4):
        s = LoadBalancingDistributedSampler(dataset, complexity_fn=len, num_replicas=4, rank=rank, shuffle=True, seed=0)
        batch_sampler = LoadBalancingDistributedBatchSampler(s, batch_fn=batches_of(8))
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=pad)
        for epoch in range(2):
            batch_sampler.set_epoch(epoch)
            batches = list(loader)
            assert len(batches) == len(batch_sampler) == math.ceil(math.ceil(203 / 4) / 8)
            assert [b[:, 0].tolist() for b in batches] == list(batch_sampler)
            if epoch == 1:
                seen += [i for b in batches for i in b[:, 0].tolist()]
    assert set(seen) == set(range(203))


def test_dataloader_with_the_plain_sampler_and_a_batch_size():
    dataset = Sequences(lognormal_lengths(100))
    s = LoadBalancingDistributedSampler(dataset, complexity_fn=len, world_size=2, rank=1)
    s.set_epoch(2)
    loader = torch.utils.data.DataLoader(dataset, sampler=s, batch_size=8, collate_fn=pad)
    assert [i for b in loader for i in b[:, 0].tolist()] == list(s)
    assert len(loader) == math.ceil(50 / 8)


def test_batch_counts_are_evened_out_by_repeating_or_dropping():
    lengths = lognormal_lengths(400)

    def token_budget(indices: list[int]) -> list[list[int]]:
        batches, current = [], []
        for i in indices:
            if current and sum(lengths[j] for j in current) + lengths[i] > 2000:
                batches.append(current)
                current = []
            current.append(i)
        return batches + [current] if current else batches

    s = sampler(lengths, 4, group_size=64)
    raw = [token_budget(share) for share in s.rank_indices()]
    counts = [len(b) for b in raw]
    padded = LoadBalancingDistributedBatchSampler(s, batch_fn=token_budget)
    dropped = LoadBalancingDistributedBatchSampler(s, batch_fn=token_budget, drop_last=True)
    assert [len(b) for b in padded.rank_batches()] == [max(counts)] * 4
    assert [len(b) for b in dropped.rank_batches()] == [min(counts)] * 4
    for rank in range(4):
        assert padded.rank_batches()[rank][: counts[rank]] == raw[rank]
        extra = padded.rank_batches()[rank][counts[rank] :]
        assert extra == [raw[rank][i % counts[rank]] for i in range(len(extra))]  # its first batches again
        assert dropped.rank_batches()[rank] == raw[rank][: min(counts)]


def test_batch_sampler_follows_the_epoch_and_accepts_a_drop_last_sampler():
    lengths = lognormal_lengths(99)
    s = sampler(lengths, 2, drop_last=True)
    batch_sampler = LoadBalancingDistributedBatchSampler(s, batch_fn=batches_of(4))
    first = list(batch_sampler)
    batch_sampler.set_epoch(1)
    assert s.epoch == batch_sampler.epoch == 1 and list(batch_sampler) != first
    s.set_epoch(0)
    assert list(batch_sampler) == first
    assert sum(len(b) for b in first) == 49


# -- arguments -----------------------------------------------------------------------------------------------------


def test_num_replicas_is_world_size():
    lengths = lognormal_lengths(50)
    by_world = LoadBalancingDistributedSampler(lengths, identity, world_size=4, rank=2)
    by_replicas = LoadBalancingDistributedSampler(lengths, identity, num_replicas=4, rank=2)
    both = LoadBalancingDistributedSampler(lengths, identity, world_size=4, num_replicas=4, rank=2)
    assert list(by_world) == list(by_replicas) == list(both)
    assert by_replicas.world_size == by_replicas.num_replicas == 4
    with pytest.raises(ValueError, match=r"world_size=4 and num_replicas=2 disagree"):
        LoadBalancingDistributedSampler(lengths, identity, world_size=4, num_replicas=2, rank=0)


def test_the_torchrun_example_call():
    lengths = lognormal_lengths(50)
    s = LoadBalancingDistributedSampler(lengths, complexity_fn=identity, num_replicas=2, rank=1, shuffle=True, seed=0)
    batch_sampler = LoadBalancingDistributedBatchSampler(s, batch_fn=batches_of(4))
    batch_sampler.set_epoch(0)
    assert sum(len(b) for b in batch_sampler) == 25


def test_signature_keeps_upstreams_arguments_and_defaults():
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or spec.origin is None:
        pytest.skip("onnxruntime is not installed")
    path = Path(spec.origin).parent / "training" / "utils" / "data" / "sampler.py"
    if not path.exists():
        pytest.skip("onnxruntime has no training samplers")
    module_spec = importlib.util.spec_from_file_location("upstream_sampler", path)  # its file only: no ORT import
    upstream = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(upstream)
    for ours, theirs in [
        (LoadBalancingDistributedSampler, upstream.LoadBalancingDistributedSampler),
        (LoadBalancingDistributedBatchSampler, upstream.LoadBalancingDistributedBatchSampler),
    ]:
        ours_parameters = inspect.signature(ours).parameters
        for name, parameter in inspect.signature(theirs).parameters.items():
            assert ours_parameters[name].default == parameter.default, name
        assert list(ours_parameters)[: len(inspect.signature(theirs).parameters)] == list(
            inspect.signature(theirs).parameters
        )


def test_world_size_and_rank_default_to_the_process_group(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:  # as if no group existed (the DeepSpeed tests keep one for the session)
        patch.setattr(dist, "is_initialized", lambda: False)
        with pytest.raises(RuntimeError, match=r"world_size \(num_replicas\) and rank not given and torch.distributed"):
            LoadBalancingDistributedSampler([1, 2, 3], identity)
        with pytest.raises(RuntimeError, match=r": rank not given and torch.distributed is not initialized"):
            LoadBalancingDistributedSampler([1, 2, 3], identity, world_size=2)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        s = LoadBalancingDistributedSampler([1, 2, 3], identity)
        assert (s.world_size, s.rank) == (1, 0)
        assert sorted(s) == [0, 1, 2]
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 4}, r"rank=4 is not allowed; expected an integer in \[0, 3\]"),
        ({"rank": -1}, r"rank=-1 is not allowed; expected an integer in \[0, 3\]"),
        ({"rank": True}, r"rank=True is not allowed"),
        ({"num_replicas": 0}, r"num_replicas=0 is not allowed; expected an integer >= 1"),
        ({"world_size": 2.0, "num_replicas": None}, r"world_size=2.0 is not allowed; expected an integer >= 1"),
        ({"group_size": 0}, r"group_size=0 is not allowed; expected an integer >= 1"),
        ({"random_level": 1.5}, r"random_level=1.5 is not allowed; expected a number in \[0, 1\]"),
        ({"random_level": -0.1}, r"random_level=-0.1 is not allowed"),
        ({"random_level": float("nan")}, r"random_level=nan is not allowed"),
        ({"shuffle": "yes"}, r"shuffle='yes' is not allowed; expected True or False"),
        ({"drop_last": None}, r"drop_last=None is not allowed; expected True or False"),
        ({"seed": 0.5}, r"seed=0.5 is not allowed; expected an integer"),
    ],
)
def test_bad_arguments_are_refused_with_the_value_and_what_is_allowed(kwargs, message):
    arguments = {"num_replicas": 4, "rank": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        LoadBalancingDistributedSampler([1, 2, 3], identity, **arguments)


def test_bad_data_set_complexities_and_batches_are_refused_by_name():
    with pytest.raises(TypeError, match=r"dataset .* has no len\(\); expected a map-style data set"):
        LoadBalancingDistributedSampler(iter([1, 2]), identity, world_size=1, rank=0)
    with pytest.raises(TypeError, match=r"complexity_fn=3 is not callable"):
        LoadBalancingDistributedSampler([1, 2], 3, world_size=1, rank=0)
    for bad in (-1, float("inf"), "long", None):
        s = LoadBalancingDistributedSampler([4, bad], identity, world_size=1, rank=0)
        with pytest.raises(ValueError, match=r"complexity_fn\(dataset\[1\]\) returned .*; expected a finite number"):
            list(s)
    with pytest.raises(ValueError, match=r"epoch=-1 is not allowed; expected an integer >= 0"):
        sampler([1, 2], 1).set_epoch(-1)
    with pytest.raises(TypeError, match=r"expected a LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(torch.utils.data.DistributedSampler([1], 1, 0), batches_of(2))
    with pytest.raises(TypeError, match=r"batch_fn=None is not callable"):
        LoadBalancingDistributedBatchSampler(sampler([1, 2], 1), None)
    positions = LoadBalancingDistributedBatchSampler(
        sampler(list(range(10, 20)), 2), lambda indices: [list(range(len(indices)))]
    )
    with pytest.raises(ValueError, match=r"returned index \d for rank 0, which is not among the indices it was given"):
        list(positions)
    empty = LoadBalancingDistributedBatchSampler(sampler([1, 2], 1), lambda indices: [indices, []])
    with pytest.raises(ValueError, match=r"an empty batch \(batch 1 of rank 0\)"):
        len(empty)
    nothing = LoadBalancingDistributedBatchSampler(sampler([1, 2, 3, 4], 2), lambda i: [i] if 0 in i else [])
    with pytest.raises(ValueError, match=r"batch_fn returned no batches for rank \d while rank \d has 1"):
        list(nothing)


# -- ortcore.utils.data and the hook ---------------------------------------------------------------------------------


def test_ortcore_utils_data_offers_both_samplers_through_the_hook(ortcore_host):
    host = ortcore_host({plugin.NAME: plugin})
    assert data.data_utilities(host) == {
        "LoadBalancingDistributedSampler": LoadBalancingDistributedSampler,
        "LoadBalancingDistributedBatchSampler": LoadBalancingDistributedBatchSampler,
    }
    previous = set_host(host)
    try:
        namespace: dict = {}
        exec(
            "from ortcore.utils.data import LoadBalancingDistributedSampler, LoadBalancingDistributedBatchSampler",
            namespace,
        )
        assert namespace["LoadBalancingDistributedSampler"] is LoadBalancingDistributedSampler
        assert namespace["LoadBalancingDistributedBatchSampler"] is LoadBalancingDistributedBatchSampler
    finally:
        set_host(previous)


def test_disabled_plugin_is_named_in_the_import_error():
    host = PluginHost(Config.from_table({"plugins": {"disable": [plugin.NAME]}}, env={}))
    assert host.records[plugin.NAME].status == "disabled"
    assert "LoadBalancingDistributedSampler" not in data.data_utilities(host)
    previous = set_host(host)
    try:
        with pytest.raises(
            ImportError, match=r"provided by plugin 'load_balancing_sampler', which is disabled; enable it"
        ):
            exec("from ortcore.utils.data import LoadBalancingDistributedSampler", {})
    finally:
        set_host(previous)


def test_declared_names_match_the_hook():
    declared = declared_names("ortcore_plugins.load_balancing_sampler", "DATA_UTILITIES")
    from ortcore.registry import Registry

    registry = Registry()
    plugin.ortcore_register(registry)
    assert set(declared) == set(registry.of("data_utility"))


# -- benchmark -----------------------------------------------------------------------------------------------------


def test_benchmark_runs_and_the_balanced_samplers_beat_torch():
    spec = importlib.util.spec_from_file_location("load_balancing_sampler_bench", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.measure(bench.sequence_lengths(2000, "lognormal"), world=4, batch=8, epochs=1, seed=0)
    assert results["torch"]["ratio"] == 1.0
    assert results["balanced, grouped"]["ratio"] < results["balanced"]["ratio"] < 1.0
    assert results["balanced"]["spread"] < 0.01 < results["torch"]["spread"]
    with pytest.raises(ValueError, match=r"distribution='uniform' is not allowed; allowed: lognormal, zipf"):
        bench.sequence_lengths(10, "uniform")
    run = subprocess.run(
        [sys.executable, str(BENCHMARK), "--samples", "500", "--world", "2", "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "| balanced, grouped |" in run.stdout
