"""Fallback to PyTorch and the ``ORTMODULE_*`` options: what falls back, what raises, and how bad values are named."""

from __future__ import annotations

import copy
import warnings

import onnx
import pytest
import torch
from torch import nn

import ortcore
from ortcore import DebugOptions, LogLevel, ORTModule

RTOL, ATOL = 1e-4, 1e-5


def assert_close(actual, expected, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


def assert_grads_match(ort_model: nn.Module, torch_model: nn.Module) -> None:
    for (name, p), (_, q) in zip(ort_model.named_parameters(), torch_model.named_parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=f"gradient of {name}")


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
    model = ORTModule(copy.deepcopy(reference))
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
    model = ORTModule(CumMax(), fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(ortcore.UnsupportedModelError, match="aten::cummax"):
        model(torch.randn(5, 4))
    assert model.state_machine.counters.fallbacks == 0


def test_fallback_disable_env_raises_naming_the_op(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = ORTModule(CumMax())
    with pytest.raises(ortcore.UnsupportedModelError, match="aten::cummax"):
        model(torch.randn(5, 4))


def test_fallback_policy_env_overrides_argument(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = ORTModule(CumMax(), fallback_policy="FALLBACK_UNSUPPORTED_TORCH_MODEL")
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
        (graph, _session), = model.state_machine._sessions.values()
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
    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", deepcopy)
    model = ORTModule(Noisy(), fallback_policy="FALLBACK_DISABLE")
    x = torch.randn(5, 4)
    before = torch.get_rng_state()
    model(x)
    assert model.state_machine.counters.exports == 1
    assert torch.equal(torch.get_rng_state(), before)
