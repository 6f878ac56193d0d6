"""fp16_optimizer: a DeepSpeed mixed-precision optimizer wrapped by FP16_Optimizer trains exactly as the same optimizer
unwrapped: same skipped steps, same loss scales, same master weights, while its per-tensor checks are not called.

Compared against real DeepSpeed 0.19 optimizers on the CPU accelerator (``DS_ACCELERATOR=cpu``, one process, gloo).
``deepspeed.initialize`` refuses fp16 on this CPU (``Type fp16 is not supported on your device.``), so fp16 runs either
construct DeepSpeed's FP16 optimizers directly or let the engine through by reporting fp16 support.

Tolerance: none. Overflow flags, loss scales, global gradient norms and fp32 master weights are bitwise equal at every
step: the replacements accumulate each norm in DeepSpeed's type (float64 in ZeRO, float32 elsewhere) and combine the
norms in DeepSpeed's order.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import ortcore_plugins.fp16_optimizer as plugin  # noqa: E402
from ortcore.config import Config  # noqa: E402
from ortcore.host import PluginHost, set_host  # noqa: E402
from ortcore_plugins.fp16_optimizer import FP16_Optimizer, has_non_finite, norm_power_sum  # noqa: E402

STEPS = 8
INF, NAN = float("inf"), float("nan")
# Steps at which one element of one gradient (of the middle layer's weight) is inf or NaN: the step is skipped.
POISON = {2: INF, 5: NAN}
POISON_STEPS = sorted(POISON)


# DeepSpeed's optimizers and engine call torch.distributed: the session's gloo world of one (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("deepspeed_world")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 2)
    )


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype)


def master_weights(optimizer) -> list[torch.Tensor]:
    """The fp32 copies DeepSpeed updates (the low-precision weights are rounded from them)."""
    for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_groups_flat", "fp32_groups"):
        if hasattr(optimizer, name):
            groups = getattr(optimizer, name)
            flat = [t for g in groups for t in (g if isinstance(g, list | tuple) else [g])]
            return [t.detach().clone() for t in flat]
    raise AssertionError(f"no fp32 master weights found on {type(optimizer).__name__}")


def record(optimizer) -> tuple:
    scale = getattr(optimizer, "loss_scale", None)
    norm = getattr(optimizer, "_global_grad_norm", None)
    return bool(optimizer.overflow), None if scale is None else float(scale), None if norm is None else float(norm)


def assert_same_training(unwrapped, wrapped) -> None:
    """Same overflow flags, loss scales and global norms at every step, same fp32 master weights, to the last bit."""
    (log_a, weights_a), (log_b, weights_b) = unwrapped, wrapped
    assert log_b == log_a
    assert all(log_a[step][0] for step in POISON_STEPS) and not all(entry[0] for entry in log_a)
    for a, b in zip(weights_a, weights_b, strict=True):
        assert torch.equal(b, a)


# -- through deepspeed.initialize ----------------------------------------------------------------------------------


def poisoned(value: float):
    """A gradient hook that sets element [3, 1] of the gradient to ``value``."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[3, 1] = value
        return grad

    return hook


def engine_training(config: dict, wrap: bool, model: torch.nn.Module | None = None):
    model = mlp() if model is None else model
    base = {"train_batch_size": 4, "gradient_clipping": 0.5, "steps_per_print": 10**9}
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config={**base, **config}
    )
    if wrap:
        assert FP16_Optimizer(optimizer) is optimizer
    dtype = next(engine.module.parameters()).dtype
    middle_weight = list(engine.module.parameters())[2]
    log = []
    for step in range(STEPS):
        x, y = batch(step, dtype)
        loss = F.mse_loss(engine(x).float(), y.float())
        if step in POISON:  # before DeepSpeed's own gradient hooks see it
            hook = middle_weight.register_hook(poisoned(POISON[step]))
        engine.backward(loss)
        if step in POISON:
            hook.remove()
        engine.step()
        log.append(record(optimizer))
    return log, master_weights(optimizer), type(optimizer).__name__


BF16 = {"bf16": {"enabled": True}}
ENGINE_CASES = {
    "zero1-bf16": ({**BF16, "zero_optimization": {"stage": 1}}, "DeepSpeedZeroOptimizer"),
    "zero2-bf16": ({**BF16, "zero_optimization": {"stage": 2}}, "DeepSpeedZeroOptimizer"),
    "zero2-fp16": (
        {"fp16": {"enabled": True, "initial_scale_power": 12}, "zero_optimization": {"stage": 2}},
        "DeepSpeedZeroOptimizer",
    ),
    "zero1-bf16-fp32-accumulation": (
        {**BF16, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
        "BF16_Optimizer",
    ),
    "no-zero-bf16": (BF16, "FP16_UnfusedOptimizer"),
}


@pytest.fixture
def fp16_allowed(monkeypatch):
    """Let the engine build fp16 optimizers: this CPU has no mkldnn fp16, which only the engine's sanity check needs."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_wrapped_engine_optimizer_trains_as_unwrapped(case, fp16_allowed):
    config, expected_type = ENGINE_CASES[case]
    *unwrapped, type_a = engine_training(config, wrap=False)
    *wrapped, type_b = engine_training(config, wrap=True)
    assert type_a == type_b == expected_type
    assert_same_training(unwrapped, wrapped)


def test_fp16_zero_skips_and_lowers_the_loss_scale_the_same_way(fp16_allowed):
    config = {
        "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 1},
        "zero_optimization": {"stage": 1},
    }
    unwrapped_log, _, _ = engine_training(config, wrap=False)
    wrapped_log, _, _ = engine_training(config, wrap=True)
    scales = [entry[1] for entry in wrapped_log]
    assert scales == [entry[1] for entry in unwrapped_log]
    assert scales[POISON_STEPS[0]] < scales[0] and scales[-1] < scales[POISON_STEPS[0]]  # halved at each overflow


def test_wrapped_zero_calls_no_per_tensor_check(fp16_allowed, monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    calls = []
    original = DeepSpeedZeroOptimizer._has_inf_or_nan

    def counting(x, j=None):
        calls.append(1)
        return original(x, j)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "_has_inf_or_nan", staticmethod(counting))
    engine_training(ENGINE_CASES["zero2-fp16"][0], wrap=True)
    assert calls == []
    engine_training(ENGINE_CASES["zero2-fp16"][0], wrap=False)
    assert calls  # the unwrapped optimizer does call it: the counter works


def test_ortmodule_model_under_zero_trains_as_unwrapped(ortcore_default_host):
    from ortcore import ORTModule

    # fp32 weights (bf16 ORTModule models: tests/test_deepspeed.py); ZeRO with fp32 weights still checks overflow and norms.
    config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    unwrapped = engine_training(config, wrap=False, model=ORTModule(mlp()))
    wrapped = engine_training(config, wrap=True, model=ORTModule(mlp()))
    assert unwrapped[2] == wrapped[2] == "DeepSpeedZeroOptimizer"
    assert_same_training(unwrapped[:2], wrapped[:2])


# -- DeepSpeed's FP16 optimizers built directly (fp16 on CPU) ------------------------------------------------------


def direct_training(kind: str, dtype: torch.dtype, wrap: bool):
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer as DeepSpeedFP16Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    cls = DeepSpeedFP16Optimizer if kind == "fused" else FP16_UnfusedOptimizer
    model = mlp().to(dtype)
    optimizer = cls(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        low_precision_dtype=dtype,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**14, "scale_window": 3, "min_scale": 1.0},
        clip_grad=0.5,
        verbose=False,
    )
    if wrap:
        assert FP16_Optimizer(optimizer) is optimizer
    log = []
    for step in range(STEPS):
        x, y = batch(step, dtype)
        optimizer.backward(F.mse_loss(model(x), y))
        if step in POISON:  # one element of one gradient: the check must look at every tensor
            model[2].weight.grad[3, 1] = POISON[step]
        optimizer.step()
        optimizer.zero_grad()
        log.append(record(optimizer))
    return (log, master_weights(optimizer)), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["fused", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wrapped_fp16_optimizer_trains_as_unwrapped(kind, dtype):
    unwrapped, weights_a = direct_training(kind, dtype, wrap=False)
    wrapped, weights_b = direct_training(kind, dtype, wrap=True)
    assert_same_training(unwrapped, wrapped)
    for a, b in zip(weights_a, weights_b):
        assert torch.equal(a, b)


# -- the multi-tensor primitives against torch ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [None, INF, -INF, NAN])
def test_has_non_finite_matches_torch_isfinite(dtype, bad):
    tensors = [torch.randn(s).to(dtype) for s in [(5, 3), (7,), (0,), (2, 2, 2)]]
    if bad is not None:
        tensors[3][1, 0, 1] = bad
    before = [t.clone() for t in tensors]
    expected = not all(torch.isfinite(t).all() for t in tensors)
    result = has_non_finite(tensors)
    assert result.shape == (1,) and result.dtype == torch.bool and bool(result) == expected
    for a, b in zip(before, tensors):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)  # the check leaves values as they are


def test_has_non_finite_of_sparse_and_empty():
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, INF], (5,), check_invariants=True)
    assert bool(has_non_finite([sparse])) and not bool(has_non_finite([]))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_norm_power_sum_matches_torch(norm_type):
    tensors = [
        torch.randn(s, dtype=torch.float64).to(dt) for s, dt in [((30, 4), torch.float16), ((9,), torch.float32)]
    ]
    flat = torch.cat([t.double().flatten() for t in tensors])
    if math.isinf(norm_type):
        expected = flat.abs().max()
    else:
        expected = flat.abs().pow(norm_type).sum()
    assert norm_power_sum(tensors, norm_type, "cpu").item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_module_function_replacements_equal_deepspeeds_bitwise(dtype):
    import deepspeed.runtime.bf16_optimizer as bf16
    import deepspeed.runtime.fp16.unfused_optimizer as unfused

    torch.manual_seed(0)
    tensors = [torch.randn(s).to(dtype) for s in [(300, 70), (70,), (5, 5, 5), (1,)]]
    for norm_type in (2, 1, math.inf):
        fast = plugin._weight_norm(unfused.get_weight_norm)(tensors, norm_type=norm_type)
        assert fast == unfused.get_weight_norm(tensors, norm_type=norm_type)
        fast = plugin._global_norm_of_tensors(bf16.get_global_norm_of_tensors)(tensors, norm_type=norm_type)
        assert torch.equal(fast, bf16.get_global_norm_of_tensors(tensors, norm_type=norm_type))
    tensors[1][3] = NAN
    assert plugin._weight_norm(unfused.get_weight_norm)(tensors) == -1 == unfused.get_weight_norm(tensors)

    def clip_inputs():
        torch.manual_seed(1)
        return [
            torch.randn(40, 3),
            torch.randn(7),
            torch.sparse_coo_tensor([[0, 4]], [3.0, -2.0], (6,), check_invariants=True),
        ]

    norm = torch.tensor(50.0)
    expected, clipped = clip_inputs(), clip_inputs()
    bf16.clip_tensors_by_global_norm(expected, max_norm=1.0, global_norm=norm)
    plugin._clip_tensors_by_global_norm(bf16.clip_tensors_by_global_norm)(clipped, max_norm=1.0, global_norm=norm)
    for a, b in zip(expected, clipped):
        assert torch.equal(b.to_dense(), a.to_dense())


# -- wrapping: idempotent, unsupported types, options --------------------------------------------------------------


def test_wrapping_twice_changes_nothing():
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    model = mlp().to(torch.float16)
    optimizer = FP16_UnfusedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    FP16_Optimizer(optimizer)
    step, check = optimizer.step, optimizer.overflow_checker.has_overflow_serial
    assert FP16_Optimizer(optimizer) is optimizer
    assert optimizer.step is step and optimizer.overflow_checker.has_overflow_serial is check
    assert not hasattr(step.__wrapped__, "__wrapped__")


def test_accelerate_wrapper_is_modified_through_the_optimizer_it_wraps():
    accelerate_deepspeed = pytest.importorskip("accelerate.utils.deepspeed")
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer as DeepSpeedFP16Optimizer

    model = mlp().to(torch.float16)
    inner = DeepSpeedFP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    wrapper = object.__new__(accelerate_deepspeed.DeepSpeedOptimizerWrapper)  # its __init__ needs accelerate's state
    wrapper.optimizer = inner
    assert FP16_Optimizer(wrapper) is wrapper
    assert inner.overflow_checker.has_overflow_serial.__func__ is plugin._checker_has_overflow_serial


def test_unsupported_optimizer_is_returned_unchanged_with_a_warning_naming_it():
    optimizer = torch.optim.AdamW(mlp().parameters())
    step = optimizer.step
    with pytest.warns(UserWarning, match=r"optimizer type torch\.optim\.adamw\.AdamW is not supported \(supported: "
                      r"deepspeed\.runtime\.zero\.stage_1_and_2\.DeepSpeedZeroOptimizer, .*\); the optimizer is "
                      r"returned unchanged"):  # fmt: skip
        assert FP16_Optimizer(optimizer) is optimizer
    assert optimizer.step == step and not hasattr(optimizer, "_ortcore_fp16_optimizer")


def test_unsupported_deepspeed_version_is_returned_unchanged(monkeypatch):
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    monkeypatch.setattr(deepspeed, "__version__", "0.9.2")
    optimizer = FP16_UnfusedOptimizer(torch.optim.SGD(mlp().half().parameters(), lr=0.1), verbose=False)
    with pytest.warns(UserWarning, match=r"DeepSpeed 0\.9\.2 is not supported \(supported: >=0\.19, <0\.20\)"):
        FP16_Optimizer(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert "has_overflow_serial" not in vars(optimizer.overflow_checker)


def test_options_are_refused_with_their_names():
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['get_horizontal_model_parallel_rank'\]"):
        FP16_Optimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), get_horizontal_model_parallel_rank=lambda: 0)


# -- ortcore.optim and the hook ------------------------------------------------------------------------------------


def test_ortcore_optim_offers_fp16_optimizer_through_the_hook(ortcore_host):
    previous = set_host(ortcore_host({plugin.NAME: plugin}))
    try:
        namespace: dict = {}
        exec("from ortcore.optim import FP16_Optimizer", namespace)
        assert namespace["FP16_Optimizer"] is FP16_Optimizer
    finally:
        set_host(previous)


def test_disabled_plugin_is_named_in_the_import_error():
    host = PluginHost(Config.from_table({"plugins": {"disable": [plugin.NAME]}}, env={}))
    assert host.records[plugin.NAME].status == "disabled"
    previous = set_host(host)
    try:
        with pytest.raises(ImportError, match=r"provided by plugin 'fp16_optimizer', which is disabled; enable it"):
            exec("from ortcore.optim import FP16_Optimizer", {})
    finally:
        set_host(previous)
