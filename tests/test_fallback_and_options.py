"""Fallback to PyTorch and the ``ORTMODULE_*`` options: what falls back, what raises, and how bad values are named."""

from __future__ import annotations

import copy
import inspect
import os
import sys
import warnings

import onnx
import pytest
import torch
from torch import nn

import ortcore
from ortcore import DebugOptions, LogLevel, ORTModule
from ortcore.options import FallbackPolicy
from ortcore.testing import make_host

RTOL, ATOL = 1e-4, 1e-5


def assert_close(actual, expected, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


def assert_grads_match(ort_model: nn.Module, torch_model: nn.Module) -> None:
    for (name, p), (_, q) in zip(ort_model.named_parameters(), torch_model.named_parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=f"gradient of {name}")


def core_host():
    """The core without plugins, configured from the process environment: there ``torch.cummax`` cannot be exported
    (plugins that run ops as ATen nodes would run it in ORT)."""
    return make_host({}, env=os.environ)


class CumMax(nn.Module):
    """``torch.cummax`` has no ONNX symbolic in torch 2.13's TorchScript exporter (``aten::cummax``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(self.fc(x), dim=1).values


class Determinant(nn.Module):
    """Exports (ONNX ``Det``), but ONNX Runtime has no gradient builder for ``Det``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.det(self.fc(x).reshape(-1, 3, 3))


class Scaler:
    """An arbitrary Python object: not a tensor, not a constant ortcore can bake into a graph."""

    def __init__(self, factor: float):
        self.factor = factor


class TakesObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scaler: Scaler) -> torch.Tensor:
        return self.fc(x) * scaler.factor


def _real_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    ignored = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
    return [w for w in caught if not issubclass(w.category, ignored)]


def train_side_by_side(model: ORTModule, reference: nn.Module, make_args, steps: int = 3) -> None:
    """A few SGD steps on both models; outputs, gradients and parameters must match torch at every step."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(steps):
        args = make_args()
        outs = []
        for m, opt in zip((model, reference), optimizers):
            opt.zero_grad()
            out = m(*args)
            out.pow(2).sum().backward()
            opt.step()
            outs.append(out)
        assert_close(outs[0], outs[1], msg=f"output at step {step}")
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert_close(p, q, msg=f"parameter {name}")


# -- fallback ------------------------------------------------------------------------------------------------------


def test_unexportable_op_falls_back_with_one_warning_naming_the_op():
    reference = CumMax()
    model = ORTModule(copy.deepcopy(reference), host=core_host())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_side_by_side(model, reference, lambda: (torch.randn(5, 4),), steps=4)
    real = _real_warnings(caught)
    assert len(real) == 1, [str(w.message) for w in real]
    assert "aten::cummax" in str(real[0].message)
    assert model.state_machine.counters.fallbacks == 1
    assert "aten::cummax" in model.fallback_reason


def test_ort_build_failure_falls_back_naming_the_op():
    reference = Determinant()
    model = ORTModule(copy.deepcopy(reference))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_side_by_side(model, reference, lambda: (torch.randn(3, 3),))
    real = _real_warnings(caught)
    assert len(real) == 1, [str(w.message) for w in real]
    assert "Det" in str(real[0].message)
    assert model.state_machine.counters.fallbacks == 1


def test_fallback_disable_argument_raises_naming_the_op():
    model = ORTModule(CumMax(), fallback_policy="FALLBACK_DISABLE", host=core_host())
    with pytest.raises(ortcore.UnsupportedModelError, match="aten::cummax"):
        model(torch.randn(5, 4))
    assert model.state_machine.counters.fallbacks == 0


def test_fallback_disable_env_raises_naming_the_op(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = ORTModule(CumMax(), host=core_host())
    with pytest.raises(ortcore.UnsupportedModelError, match="aten::cummax"):
        model(torch.randn(5, 4))


def test_fallback_policy_env_overrides_argument(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = ORTModule(CumMax(), fallback_policy="FALLBACK_UNSUPPORTED_TORCH_MODEL", host=core_host())
    with pytest.raises(ortcore.UnsupportedModelError):
        model(torch.randn(5, 4))


def test_unsupported_input_data_falls_back_under_unsupported_data_policy():
    reference = TakesObject()
    model = ORTModule(copy.deepcopy(reference), fallback_policy="FALLBACK_UNSUPPORTED_DATA")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_side_by_side(model, reference, lambda: (torch.randn(3, 4), Scaler(2.5)))
    real = _real_warnings(caught)
    assert len(real) == 1, [str(w.message) for w in real]
    assert "Scaler" in str(real[0].message)
    assert model.state_machine.counters.fallbacks == 1
    assert model.state_machine.counters.exports == 0


def test_unsupported_input_data_raises_when_not_in_policy():
    model = ORTModule(TakesObject(), fallback_policy="FALLBACK_UNSUPPORTED_TORCH_MODEL")
    with pytest.raises(ortcore.UnsupportedDataError, match="scaler"):
        model(torch.randn(3, 4), Scaler(2.0))


def test_data_parallel_is_rejected_with_ddp_hint():
    with pytest.raises(ortcore.UnsupportedModelError, match="DistributedDataParallel"):
        ORTModule(nn.DataParallel(nn.Linear(4, 4)))


def test_distributed_wrappers_are_rejected_with_the_order_that_works(tmp_path):
    """DDP (or a DeepSpeed engine) inside ORTModule would run its forward only while exporting and never reduce
    gradients: refused, naming the order that works."""
    import torch.distributed as dist

    created = not dist.is_initialized()  # other tests (DeepSpeed's) may keep a group for the session
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ortcore.UnsupportedModelError, match=r"DistributedDataParallel\(ORTModule\(model\)\)"):
            ORTModule(nn.parallel.DistributedDataParallel(nn.Linear(4, 4)))
    finally:
        if created:
            dist.destroy_process_group()

    class DeepSpeedEngine(nn.Module):  # matched by name: ortcore does not import deepspeed
        pass

    with pytest.raises(ortcore.UnsupportedModelError, match=r"cannot wrap DeepSpeedEngine.*deepspeed.initialize"):
        ORTModule(DeepSpeedEngine())


def test_ort_uses_as_many_threads_as_torch():
    """torchrun sets OMP_NUM_THREADS=1 for several ranks per machine; ORT's sessions follow torch's thread count."""
    from ortcore.pipeline import base_session_options

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert base_session_options(LogLevel.WARNING).intra_op_num_threads == 1
    finally:
        torch.set_num_threads(before)
    assert base_session_options(LogLevel.WARNING).intra_op_num_threads == before


# -- bad option values ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("ORTMODULE_LOG_LEVEL", "LOUD", ["VERBOSE", "INFO", "WARNING", "FATAL"]),
        ("ORTMODULE_ONNX_OPSET_VERSION", "seventeen", ["integer"]),
        ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_SOMETIMES", ["FALLBACK_DISABLE", "FALLBACK_UNSUPPORTED_DATA"]),
        ("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "maybe", ["1", "0", "true", "false"]),
    ],
)
def test_bad_env_value_raises_option_error_naming_variable_value_and_allowed(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, allowed: list[str]
):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ortcore.OptionError) as raised:
        ORTModule(nn.Linear(4, 4))
    message = str(raised.value)
    assert variable in message
    assert value in message
    for word in allowed:
        assert word in message, f"{word!r} missing from: {message}"


@pytest.mark.parametrize(
    ("value", "suggestion"),
    [
        ("FALLBACK_BOGUS", None),
        ("FALLBACK_ENABLE", None),
        ("FALLBACK_NONE", None),
        ("FALLBACK_ALL", None),
        ("bogus", None),
        ("FALLBACK_DISABEL", "FALLBACK_DISABLE"),
        ("disabled", "FALLBACK_DISABLE"),
        ("FALLBACK_UNSUPORTED_DATA", "FALLBACK_UNSUPPORTED_DATA"),
        ("unsupported_device|unsupported_dat", "FALLBACK_UNSUPPORTED_DATA"),
    ],
)
def test_a_bad_fallback_policy_is_suggested_by_spelling_only_when_close(value, suggestion):
    """A suggestion is for a misspelling: FALLBACK_DISABLE, the one flag that turns every fallback off, is never
    offered for a value that is not a close misspelling of it; otherwise the error lists every flag."""
    with pytest.raises(ortcore.OptionError) as raised:
        FallbackPolicy.parse(value, "ORTMODULE_FALLBACK_POLICY")
    message = str(raised.value)
    assert message.startswith(f"ORTMODULE_FALLBACK_POLICY={value!r}: ")
    assert all(name in message for name in FallbackPolicy.__members__), message
    if suggestion is None:
        assert "Did you mean" not in message, message
    else:
        assert message.endswith(f". Did you mean {suggestion!r}?"), message


def test_a_bogus_fallback_policy_in_the_environment_is_not_turned_into_disable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_BOGUS")
    with pytest.raises(ortcore.OptionError) as raised:
        ORTModule(nn.Linear(4, 4))
    assert "'FALLBACK_BOGUS' is not a fallback policy" in str(raised.value)
    assert "Did you mean" not in str(raised.value)


@pytest.mark.parametrize(
    "value",
    [
        "FALLBACK_DISABLE|FALLBACK_UNSUPPORTED_DATA",
        "unsupported_data | disable",
        17,
        FallbackPolicy.FALLBACK_DISABLE | FallbackPolicy.FALLBACK_UNSUPPORTED_DATA,
    ],
)
def test_fallback_disable_combined_with_other_flags_is_refused(value):
    """FALLBACK_DISABLE turns every fallback off: with other flags, one of the two intentions would be dropped."""
    with pytest.raises(ortcore.OptionError) as raised:
        ORTModule(nn.Linear(4, 4), fallback_policy=value)
    message = str(raised.value)
    assert message.startswith(f"fallback_policy={value!r}: FALLBACK_DISABLE cannot be combined with other flags")
    assert "FALLBACK_UNSUPPORTED_DATA" in message and "alone" in message


def test_fallback_disable_combined_in_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE|FALLBACK_UNSUPPORTED_DATA")
    with pytest.raises(
        ortcore.OptionError,
        match=r"ORTMODULE_FALLBACK_POLICY='FALLBACK_DISABLE\|FALLBACK_UNSUPPORTED_DATA': FALLBACK_DISABLE cannot be",
    ):
        ORTModule(nn.Linear(4, 4))


def test_fallback_disable_alone_is_accepted_however_written():
    for value in ("FALLBACK_DISABLE", "disable", "FALLBACK_DISABLE|DISABLE", 1, FallbackPolicy.FALLBACK_DISABLE):
        assert FallbackPolicy.parse(value) == FallbackPolicy.FALLBACK_DISABLE


def test_option_error_is_a_value_error():
    with pytest.raises(ValueError):
        ORTModule(nn.Linear(4, 4), fallback_policy="NO_SUCH_POLICY")


def test_env_log_level_overrides_debug_options(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "ERROR")
    model = ORTModule(nn.Linear(4, 4), DebugOptions(log_level=LogLevel.INFO))
    assert model.runtime_options.log_level == LogLevel.ERROR


def test_debug_options_log_level_applies_without_env():
    model = ORTModule(nn.Linear(4, 4), DebugOptions(log_level=LogLevel.INFO))
    assert model.runtime_options.log_level == LogLevel.INFO


class Normalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.fc(x))))


def test_env_opset_version_is_honoured(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "14")
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    reference = Normalized()
    model = ORTModule(
        copy.deepcopy(reference),
        DebugOptions(save_onnx=True, onnx_prefix="opset"),
        opset=17,
        fallback_policy="FALLBACK_DISABLE",
    )
    assert model.runtime_options.opset == 14
    train_side_by_side(model, reference, lambda: (torch.randn(5, 4),), steps=2)
    exported = onnx.load(str(tmp_path / "opset_pre_grad_training.onnx"))
    opsets = {entry.domain: entry.version for entry in exported.opset_import}
    assert opsets[""] == 14


def test_symbolics_of_one_model_at_another_opset_do_not_leak_into_the_next(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A symbolic registered for opset 14 serves every later opset in torch's registry: a model whose plugins route
    GELU to an ATen node at opset 14 must not make the next model (other plugins, opset 17) export ATen nodes."""
    import ortcore_plugins.aten_fallback as aten_fallback
    from ortcore.testing import make_host

    class Gelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return nn.functional.gelu(self.fc(x))

    def exported_ops(host, opset):
        model = ORTModule(Gelu(), host=host, opset=opset, fallback_policy="FALLBACK_DISABLE")
        model(torch.randn(2, 4)).sum().backward()
        ((graph, _session),) = model.state_machine._sessions.values()
        return {n.op_type for n in graph.model.graph.node}

    assert "ATen" in exported_ops(make_host({"aten_fallback": aten_fallback}), 14)
    assert "ATen" not in exported_ops(make_host({}), 17)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


@pytest.mark.parametrize("deepcopy", ["0", "1"])
def test_export_leaves_batch_norm_statistics_untouched(monkeypatch: pytest.MonkeyPatch, deepcopy: str):
    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", deepcopy)
    reference = BatchNormNet()
    model = ORTModule(copy.deepcopy(reference), fallback_policy="FALLBACK_DISABLE")
    assert model.runtime_options.deepcopy_before_export is (deepcopy == "1")
    train_side_by_side(model, reference, lambda: (torch.randn(8, 4),), steps=3)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(getattr(model.bn, name), getattr(reference.bn, name), msg=name)
    assert int(model.bn.num_batches_tracked) == 3  # the export's tracing run did not count as a step


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)) + torch.rand_like(x)


@pytest.mark.parametrize("deepcopy", ["0", "1"])
def test_export_leaves_torch_rng_untouched(monkeypatch: pytest.MonkeyPatch, deepcopy: str):
    """Tracing draws nothing from torch's generator; the call itself draws ORT's seed (the random_seed plugin: one
    number per call of a graph with random ops) and nothing else."""
    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", deepcopy)
    model = ORTModule(Noisy(), fallback_policy="FALLBACK_DISABLE")
    x = torch.randn(5, 4)
    before = torch.get_rng_state()
    model(x)
    assert model.state_machine.counters.exports == 1
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    torch.randint(0, 2**63 - 1, (), dtype=torch.int64)  # the seed random_seed draws for ORT's dropout
    assert torch.equal(after, torch.get_rng_state())


# -- the model's own errors, fallback per kind of call, where the warning points ---------------------------------------


def _eager_error(model: nn.Module, *args, **kwargs) -> BaseException:
    with pytest.raises(Exception) as raised:
        model(*args, **kwargs)
    return raised.value


def _assert_raised_as_pytorch(raised: BaseException, eager: BaseException) -> None:
    assert type(raised) is type(eager)
    assert str(raised) == str(eager)
    assert raised.__cause__ is None and raised.__context__ is None  # not chained to any ortcore error
    last = raised.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    eager_last = eager.__traceback__
    while eager_last.tb_next is not None:
        eager_last = eager_last.tb_next
    assert last.tb_frame.f_code is eager_last.tb_frame.f_code  # raised where PyTorch raises it


@pytest.mark.parametrize("policy", [None, "FALLBACK_DISABLE"])
@pytest.mark.parametrize(
    "bad_call",
    [
        pytest.param(lambda: ([torch.randn(3, 4)],), id="list-instead-of-tensor"),
        pytest.param(lambda: (torch.randn(3, 5),), id="wrong-feature-size"),
    ],
)
def test_models_own_error_while_tracing_is_raised_as_pytorch_raises_it_and_nothing_falls_back(policy, bad_call):
    reference = nn.Linear(4, 4)
    model = ORTModule(copy.deepcopy(reference), fallback_policy=policy)
    args = bad_call()
    eager = _eager_error(reference, *args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(type(eager)) as raised:
            model(*args)
    _assert_raised_as_pytorch(raised.value, eager)
    assert not isinstance(raised.value, ortcore.ORTCoreError)
    assert _real_warnings(caught) == []
    assert model.state_machine.counters.fallbacks == 0
    assert model.fallback_reason is None
    # The next, correct call runs in ORT and matches PyTorch.
    train_side_by_side(model, reference, lambda: (torch.randn(3, 4),), steps=2)
    assert model.state_machine.counters.exports == 1
    assert model.state_machine.counters.fallbacks == 0


@pytest.mark.parametrize("policy", [None, "FALLBACK_DISABLE"])
def test_arguments_that_do_not_match_forward_raise_pytorchs_type_error(policy):
    reference = nn.Linear(4, 4)
    model = ORTModule(copy.deepcopy(reference), fallback_policy=policy)
    x = torch.randn(3, 4)
    eager = _eager_error(reference, x, scale=2.0)
    with pytest.raises(TypeError) as raised:
        model(x, scale=2.0)
    _assert_raised_as_pytorch(raised.value, eager)
    assert model.state_machine.counters.fallbacks == 0
    assert_close(model(x), reference(x))
    assert model.state_machine.counters.exports == 1


class MaybeCumMax(nn.Module):
    """Exports with ``op="linear"``; with ``op="cummax"`` the core's exporter cannot (``aten::cummax``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cummax_enabled = True

    def forward(self, x: torch.Tensor, op: str = "linear") -> torch.Tensor:
        y = self.fc(x)
        if op == "cummax" and self.cummax_enabled:
            return torch.cummax(y, dim=1).values
        return y


def _train_calls(model: nn.Module, reference: nn.Module, op: str, steps: int = 1) -> None:
    for _ in range(steps):
        x = torch.randn(5, 4)
        out, expected = model(x, op=op), reference(x, op=op)
        assert_close(out, expected, msg=f"output of op={op}")
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        assert_grads_match(model, reference)


def _export_attempts(model: ORTModule) -> int:
    return sum(t.action == "export" for t in model.state_machine.history)


def test_after_a_fallback_a_call_with_another_schema_runs_in_ort_and_the_failed_one_stays_in_pytorch():
    reference = MaybeCumMax()
    model = ORTModule(copy.deepcopy(reference), host=core_host())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_calls(model, reference, "cummax")
        assert model.state_machine.counters.fallbacks == 1
        assert "aten::cummax" in model.fallback_reason
        _train_calls(model, reference, "linear", steps=2)  # another GraphKey: tries ORT, which runs it
        assert model.fallback_reason is None
        assert model.state_machine.counters.exports == 1
        attempts = _export_attempts(model)
        _train_calls(model, reference, "cummax", steps=2)  # the failed key: PyTorch, without exporting again
        assert _export_attempts(model) == attempts
        assert "aten::cummax" in model.fallback_reason
        _train_calls(model, reference, "linear")
    assert len(_real_warnings(caught)) == 1
    counters = model.state_machine.counters
    assert (counters.exports, counters.builds, counters.fallbacks) == (1, 1, 1)


def test_fallback_retry_tries_ort_again_for_the_failed_call(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_RETRY", "1")
    reference = MaybeCumMax()
    model = ORTModule(copy.deepcopy(reference), host=core_host())
    assert model.runtime_options.fallback_retry is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_calls(model, reference, "cummax")
        assert _export_attempts(model) == 1
        _train_calls(model, reference, "cummax", steps=2)
        assert _export_attempts(model) == 3  # every call tried ORT again
    assert len(_real_warnings(caught)) == 1  # one warning for the kind of call, not one per retry
    assert model.state_machine.counters.fallbacks == 1
    assert model.state_machine.counters.exports == 0


def test_changing_the_model_lets_a_call_that_fell_back_try_ort_again():
    reference = MaybeCumMax()
    model = ORTModule(copy.deepcopy(reference), host=core_host())
    with pytest.warns(RuntimeWarning, match="aten::cummax"):
        _train_calls(model, reference, "cummax")
    model.cummax_enabled = False
    reference.cummax_enabled = False
    _train_calls(model, reference, "cummax", steps=2)
    assert model.fallback_reason is None
    assert model.state_machine.counters.exports == 1
    assert any(t.action == "reset" and "cummax_enabled" in t.reason for t in model.state_machine.history)


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "with-forward-hooks"])
def test_fallback_warning_points_at_the_users_call(hooked: bool):
    model = ORTModule(CumMax(), host=core_host())
    if hooked:  # torch's slower call path, one frame deeper
        model.register_forward_pre_hook(lambda module, args: None)
        model.register_forward_hook(lambda module, args, output: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        model(torch.randn(3, 4))
    (warning,) = _real_warnings(caught)
    assert (warning.filename, warning.lineno) == (__file__, line)


class CallsInner(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2  # the line the fallback warning names


def test_fallback_warning_inside_a_users_model_points_at_the_line_calling_the_ortmodule():
    outer = CallsInner(ORTModule(CumMax(), host=core_host()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outer(torch.randn(3, 4))
    (warning,) = _real_warnings(caught)
    source_lines, start = inspect.getsourcelines(CallsInner.forward)
    line = start + next(i for i, text in enumerate(source_lines) if "the line the fallback warning names" in text)
    assert (warning.filename, warning.lineno) == (__file__, line)
