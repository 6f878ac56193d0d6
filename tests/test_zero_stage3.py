"""DeepSpeed ZeRO stage 3 over an ORTModule (the ``zero_stage3`` plugin) trains like ZeRO-3 over the model.

Each test trains the tiny GPT-2 (tests/models.py, dropout off) from the same weights on the same batches twice:
``deepspeed.initialize(model=ORTModule(model), ...)`` with ``"stage": 3``, and stock DeepSpeed ZeRO-3 over the model
itself (the reference), both with ortcore's FusedAdam as the client optimizer; it compares the losses and the final
parameters, gathered (``deepspeed.zero.GatheredParameters``). The ORTModule side must run in ORT: one export, no
fallback (``fallback_policy="FALLBACK_DISABLE"``).

Tolerances (fp32), derived as in tests/test_deepspeed.py: the two sides differ only in the order ORT and PyTorch
sum in the forward and backward, so losses get 1e-5 relative (measured: 2.0e-7); Adam divides each gradient by its
own running scale, so a weight whose gradient is ~0 can move by up to ``lr`` differently per step: parameters get
rtol 1e-5 plus atol ``STEPS * LR * 0.01`` (1% of that worst case; measured 6.1e-7).

Everything runs in the session's gloo world of one process (tests/conftest.py); the ``slow`` test trains on two.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from models import assert_ran_in_ort, gpt2_batch, make_batches, run_ranks, tiny_gpt2

from ortcore import ORTModule
from ortcore.config import Config
from ortcore.host import PluginHost

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read once, when DeepSpeed first picks its accelerator
deepspeed = pytest.importorskip("deepspeed")
optim = pytest.importorskip("ortcore.optim")
FusedAdam, AdamWMode = optim.FusedAdam, optim.AdamWMode

pytestmark = pytest.mark.usefixtures("deepspeed_world", "torch_linear_restored")


@pytest.fixture
def torch_linear_restored() -> Any:
    """ZeRO stage 3 replaces ``torch.nn.functional.linear`` process-wide ("This will persist unless manually
    reset"): put torch's back, so that later tests see the environment they started in."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear

STEPS = 4
LR = 1e-3
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
PARAM_ATOL = STEPS * LR * 0.01


def ds_config(**zero: Any) -> dict[str, Any]:
    """ZeRO stage 3, fp32; ``zero`` updates ``zero_optimization`` (``gradient_accumulation_steps`` goes to the top)."""
    accumulation = zero.pop("gradient_accumulation_steps", 1)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, **zero},
        "zero_allow_untested_optimizer": True,  # FusedAdam is not one of DeepSpeed's optimizers
    }
    if "offload_optimizer" in zero:
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def batches(n: int = STEPS) -> list[dict[str, torch.Tensor]]:
    distinct = make_batches(gpt2_batch, 2, seed=1234)
    return [distinct[i % 2] for i in range(n)]


def engine_for(model: torch.nn.Module, config: dict[str, Any]) -> Any:
    optimizer = FusedAdam(model.parameters(), lr=LR, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def train(engine: Any, data: list[dict[str, torch.Tensor]]) -> list[float]:
    losses = []
    for batch in data:
        loss = engine(**batch, labels=batch["input_ids"]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DeepSpeed gathers and partitions again), by name."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def ortmodule(model: torch.nn.Module) -> ORTModule:
    return ORTModule(model, fallback_policy="FALLBACK_DISABLE")


def run(
    config: dict[str, Any], wrap: bool, data: list | None = None, check: Any = None, zero_init: bool = False
) -> tuple[list[float], dict, Any, Any]:
    """Train (``zero_init``: a model built under ``deepspeed.zero.Init``, partitioned from its construction);
    ``check(model)`` runs after the last step, before the parameters are gathered for the comparison."""
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config) if zero_init else contextlib.nullcontext():
        model = tiny_gpt2()
    model = ortmodule(model) if wrap else model
    engine = engine_for(model, config)
    losses = train(engine, data or batches())
    if check is not None:
        check(model)
    return losses, gathered(model), model, engine


def assert_same(reference: tuple, ours: tuple) -> None:
    ref_losses, ref_params = reference[:2]
    losses, params = ours[:2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def assert_partitioned(model: torch.nn.Module, world: int = 1, persistent_allowed: bool = False) -> None:
    """Between steps every parameter is a shard: ``param.data`` empty, ``ds_tensor`` this rank's piece."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for name, p in model.named_parameters():
        if persistent_allowed and p.ds_persist:
            assert p.ds_status == ZeroParamStatus.AVAILABLE, name
            continue
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE, (name, p.ds_status)
        assert p.data.numel() == 0, (name, p.data.shape)
        assert p.ds_tensor.numel() == math.ceil(p.ds_numel / world), (name, p.ds_tensor.shape, p.ds_numel)


@pytest.mark.parametrize("threshold", [0, None], ids=["persistence_0", "persistence_default"])
def test_zero3_trains_like_deepspeed_over_the_model(threshold: int | None) -> None:
    zero = {} if threshold is None else {"stage3_param_persistence_threshold": threshold}
    check = functools.partial(assert_partitioned, persistent_allowed=threshold is None)
    reference = run(ds_config(**zero), wrap=False, check=check)
    ours = run(ds_config(**zero), wrap=True, check=check)
    assert_same(reference, ours)
    model = ours[2]
    assert_ran_in_ort(model, exports=1)  # DeepSpeed's per-step bookkeeping on the ORTModule exports nothing again
    if threshold is None:  # DeepSpeed's default keeps small parameters whole: the tiny model's are all small
        assert all(p.ds_persist for p in model.parameters())


def test_zero3_second_job_finds_its_graph_under_the_same_export_cache_key(tmp_path: Path, monkeypatch) -> None:
    """A second ORTModule of the same model under ZeRO-3 (a job started again) looks up the same export cache key:
    DeepSpeed's hooks count in the graph's fingerprint by their code, not by the per-engine state they are bound to
    (handle ids, counters). The graph it finds runs DeepSpeed's stage-3 linear (a custom autograd Function, a
    PythonOp), which a cached graph cannot carry across processes, so it is exported again; it trains like ZeRO-3
    over the model and stays partitioned."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(cache))
    monkeypatch.setenv("ORTCORE_KERNEL_MEASURE", "off")  # one entry per key whatever the machine's load
    config = ds_config(stage3_param_persistence_threshold=0)
    reference = run(config, wrap=False)
    first = run(config, wrap=True)
    graphs = sorted(cache.glob("*.ortgraph"))
    second = run(config, wrap=True, check=assert_partitioned)
    assert_same(reference, first)
    assert_same(reference, second)
    assert len(graphs) == 1 and sorted(cache.glob("*.ortgraph")) == graphs  # one key for both jobs


def test_zero3_parameters_gathered_only_while_ort_needs_them() -> None:
    """Shards between steps; whole from ORT's forward to the end of its backward (the graph's inputs, which ORT's
    backward reads); shards again after a call without a backward."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(0)
    model = ortmodule(tiny_gpt2())
    engine = engine_for(model, ds_config(stage3_param_persistence_threshold=0))
    batch = batches(1)[0]
    for _ in range(2):
        assert_partitioned(model)
        loss = engine(**batch, labels=batch["input_ids"]).loss
        assert {p.ds_status for p in model.parameters()} == {ZeroParamStatus.AVAILABLE}
        engine.backward(loss)
        assert_partitioned(model)
        engine.step()
        assert_partitioned(model)
    with torch.no_grad():
        engine(**batch, labels=batch["input_ids"])
    assert_partitioned(model)
    assert_ran_in_ort(model)


def test_zero3_gradient_accumulation_and_overlap_comm() -> None:
    zero = dict(
        stage3_param_persistence_threshold=0,
        overlap_comm=True,
        reduce_bucket_size=4096,
        stage3_prefetch_bucket_size=4096,
        gradient_accumulation_steps=2,
    )
    data = batches(2 * STEPS)
    reference = run(ds_config(**zero), wrap=False, data=data)
    ours = run(ds_config(**zero), wrap=True, data=data, check=assert_partitioned)
    assert_same(reference, ours)
    assert_ran_in_ort(ours[2], exports=1)


def test_zero3_offload_param_and_optimizer_to_cpu() -> None:
    zero = dict(
        stage3_param_persistence_threshold=0,
        offload_param={"device": "cpu"},
        offload_optimizer={"device": "cpu"},
    )
    reference = run(ds_config(**zero), wrap=False)
    ours = run(ds_config(**zero), wrap=True, check=assert_partitioned)
    assert_same(reference, ours)
    assert_ran_in_ort(ours[2], exports=1)


def test_zero3_checkpoint_resume_continues_the_curve(tmp_path: Path) -> None:
    """save_checkpoint after 2 steps, load into a fresh engine over a fresh ORTModule: the next steps are those of
    the run that went on, and those of ZeRO-3 over the model."""
    config = ds_config(stage3_param_persistence_threshold=0)
    data = batches(STEPS)
    reference = run(config, wrap=False, data=data)

    torch.manual_seed(0)
    model = ortmodule(tiny_gpt2())
    engine = engine_for(model, config)
    first = train(engine, data[:2])
    engine.save_checkpoint(str(tmp_path), tag="half")
    went_on = train(engine, data[2:])

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    resumed_model = ortmodule(tiny_gpt2())
    resumed = engine_for(resumed_model, config)
    resumed.load_checkpoint(str(tmp_path), tag="half")
    assert_partitioned(resumed_model)
    after = train(resumed, data[2:])

    torch.testing.assert_close(torch.tensor(after), torch.tensor(went_on), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(first + after), torch.tensor(reference[0]), rtol=LOSS_RTOL, atol=0)
    ref_params, params = reference[1], gathered(resumed_model)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    assert_ran_in_ort(resumed_model, exports=1)


def test_zero3_model_built_under_zero_init() -> None:
    """A model built under ``deepspeed.zero.Init`` is partitioned from its construction (ZeRO-3 initialises each
    shard on its own, so the reference is built so too); ORTModule wraps it partitioned."""
    config = ds_config(stage3_param_persistence_threshold=0)
    reference = run(config, wrap=False, zero_init=True)
    ours = run(config, wrap=True, zero_init=True, check=assert_partitioned)
    assert_same(reference, ours)
    assert_ran_in_ort(ours[2], exports=1)


def test_ortmodule_over_a_deepspeed_engine_is_refused() -> None:
    torch.manual_seed(0)
    engine = engine_for(tiny_gpt2(), ds_config())
    with pytest.raises(
        Exception, match=r"ORTModule cannot wrap DeepSpeedEngine.*deepspeed.initialize\(model=ORTModule"
    ):
        ORTModule(engine)


def test_zero3_refused_when_the_plugin_is_switched_off() -> None:
    torch.manual_seed(0)
    config = ds_config(stage3_param_persistence_threshold=0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = tiny_gpt2()
    off = PluginHost(Config.from_table({}, env={"ORTMODULE_ENABLE_ZERO_STAGE3": "0"}))
    with pytest.raises(Exception, match=r"ZeRO stage 3 parameters .*ORTMODULE_ENABLE_ZERO_STAGE3=0"):
        ORTModule(model, host=off)


def test_enable_option_values() -> None:
    from ortcore.errors import OptionError

    for value, parsed in (("1", "on"), ("0", "off"), ("auto", "auto"), ("true", "on")):
        host = PluginHost(Config.from_table({}, env={"ORTMODULE_ENABLE_ZERO_STAGE3": value}))
        assert host.config.plugin_options("zero_stage3").enable == parsed
    with pytest.raises(OptionError, match=r"ORTMODULE_ENABLE_ZERO_STAGE3='2' is not allowed; allowed: 1 .*0 .*auto"):
        PluginHost(Config.from_table({}, env={"ORTMODULE_ENABLE_ZERO_STAGE3": "2"}))


# -- two processes ----------------------------------------------------------------------------------------------
WORKER = """
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, {tests!r})
import deepspeed, torch
import test_zero_stage3 as t
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
rank = torch.distributed.get_rank()
data = [b for i, b in enumerate(t.batches(2 * t.STEPS)) if i % 2 == rank]  # each rank its own micro-batches
out = {{}}
for zero in ({{"stage3_param_persistence_threshold": 0}}, {{}}, {{"stage3_param_persistence_threshold": 0,
             "overlap_comm": True, "gradient_accumulation_steps": 2}}):
    check = lambda model: t.assert_partitioned(model, world=2, persistent_allowed=not zero)
    reference = t.run(t.ds_config(**dict(zero)), wrap=False, data=data, check=check)
    ours = t.run(t.ds_config(**dict(zero)), wrap=True, data=data, check=check)
    t.assert_same(reference, ours)
    t.assert_ran_in_ort(ours[2], exports=1)
    out[json.dumps(zero)] = ours[0]
print("LOSSES", rank, json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_zero3_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    for rank, out in enumerate(run_ranks(script)):
        assert f"LOSSES {rank}" in out
