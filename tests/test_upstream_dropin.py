"""Code and tests written for upstream's ORTModule keep working: DebugOptions checks its arguments when constructed,
saved graphs carry upstream's file names too, buffers, parameters and attributes registered on an ORTModule go to the
wrapped model (and the next call sees them), and ``ortcore.ONNX_OPSET_VERSION``."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import types

import onnx
import pytest
import torch
from torch import nn

import ortcore
from ortcore import DebugOptions, LogLevel, ORTModule

RTOL, ATOL = 1e-4, 1e-5


def assert_close(actual, expected, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


def assert_grads_match(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=f"gradient of {name}")


def step_matches_torch(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward on both; outputs and every parameter's gradient must match."""
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    out, expected = model(x), reference(x)
    assert_close(out, expected, msg="output")
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_match(model, reference)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


# -- DebugOptions checks its own arguments --------------------------------------------------------------------------


def test_debug_options_with_a_missing_save_directory_raises_oserror_naming_it(monkeypatch: pytest.MonkeyPatch):
    with tempfile.TemporaryDirectory() as gone:
        pass
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", gone)
    with pytest.raises(OSError) as raised:
        DebugOptions(save_onnx=True, onnx_prefix="my_model")
    assert f"Directory {gone} is not writable." in str(raised.value)  # upstream's words
    assert "ORTMODULE_SAVE_ONNX_PATH" in str(raised.value)


def test_debug_options_save_path_that_is_a_file_raises_oserror_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="a_file"):
        DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(blocker))


def test_debug_options_environment_directory_wins_over_save_path(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    options = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(tmp_path / "missing"))
    assert options.save_directory == str(tmp_path)


def test_debug_options_directory_is_checked_only_when_saving(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path / "missing"))
    assert DebugOptions(log_level=LogLevel.INFO).save_onnx is False


@pytest.mark.parametrize("prefix", [23, None, b"bytes"])
def test_debug_options_prefix_that_is_not_a_string_is_a_type_error_naming_it(prefix):
    with pytest.raises(TypeError) as raised:
        DebugOptions(save_onnx=True, onnx_prefix=prefix)
    assert f"Expected name prefix of type str, got {type(prefix)}." in str(raised.value)  # upstream's words
    assert repr(prefix) in str(raised.value)
    assert isinstance(raised.value, ortcore.OptionError)


@pytest.mark.parametrize("prefix", ["", "   "])
def test_debug_options_missing_prefix_is_a_value_error(prefix):
    with pytest.raises(ValueError) as raised:
        DebugOptions(save_onnx=True, onnx_prefix=prefix)
    assert "onnx_prefix must be provided when save_onnx is set." in str(raised.value)  # upstream's words
    assert repr(prefix) in str(raised.value)


@pytest.mark.parametrize("level", ["some_string", 3.5, object(), 9])
def test_debug_options_log_level_that_is_not_a_log_level_is_a_type_error_naming_it(level):
    with pytest.raises(TypeError) as raised:
        DebugOptions(log_level=level)
    message = str(raised.value)
    assert f"Expected log_level of type LogLevel, got {type(level)}." in message  # upstream's words
    assert repr(level) in message
    assert "VERBOSE" in message and "FATAL" in message  # what is allowed


def test_debug_options_accepts_what_upstream_accepts():
    options = DebugOptions(LogLevel.INFO, True, "m", os.getcwd())
    assert (options.log_level, options.save_onnx, options.onnx_prefix) == (LogLevel.INFO, True, "m")
    assert {level.name: int(level) for level in LogLevel} == {
        "VERBOSE": 0,
        "DEVINFO": 1,
        "INFO": 2,
        "WARNING": 3,
        "ERROR": 4,
        "FATAL": 5,
    }


# -- saved graphs under upstream's names ----------------------------------------------------------------------------


def _saved(directory) -> set[str]:
    names = set(os.listdir(directory))
    assert not [n for n in names if ".tmp" in n], names  # every file was renamed into place
    return names


def test_training_saves_upstreams_four_graphs_and_ortcores(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    reference = Small()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(save_onnx=True, onnx_prefix="my_model"))
    step_matches_torch(model, reference, torch.randn(5, 4))
    names = _saved(tmp_path)
    kinds = ("torch_exported", "optimized_pre_grad", "optimized", "execution_model")
    upstream = {f"my_model_{kind}_training.onnx" for kind in kinds}
    ortcore_names = {"my_model_exported_training.onnx", "my_model_pre_grad_training.onnx", "my_model_training.onnx"}
    assert upstream | ortcore_names <= names
    assert not [n for n in names if "inference" in n]
    graphs = {n: onnx.load(str(tmp_path / n)) for n in upstream}
    ops = {n: {node.op_type for node in g.graph.node} for n, g in graphs.items()}
    # The exporter's graph and the pre-gradient graph have no backward; the optimized one is the gradient graph.
    assert "YieldOp" not in ops["my_model_torch_exported_training.onnx"]
    assert ops["my_model_torch_exported_training.onnx"] & {"Gemm", "MatMul"}
    assert "YieldOp" not in ops["my_model_optimized_pre_grad_training.onnx"]
    assert {"YieldOp", "ReluGrad"} <= ops["my_model_optimized_training.onnx"]
    assert "YieldOp" in ops["my_model_execution_model_training.onnx"]
    optimized = graphs["my_model_optimized_training.onnx"]
    assert {o.name for o in optimized.graph.output} >= {"fc1.weight_grad", "fc2.bias_grad"}
    ortcores, upstreams = (tmp_path / "my_model_training.onnx"), (tmp_path / "my_model_optimized_training.onnx")
    assert ortcores.read_bytes() == upstreams.read_bytes()


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_inference_mode_saves_upstreams_inference_names(monkeypatch: pytest.MonkeyPatch, tmp_path, how: str):
    """Upstream's mode is "training" only for a model in train() with grad enabled (its ``is_training``)."""
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    reference = Small()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(save_onnx=True, onnx_prefix="my_cwd_model"))
    x = torch.randn(5, 4)
    if how == "eval":
        model.eval()
        reference.eval()
        assert_close(model(x), reference(x))
    else:
        with torch.no_grad():
            assert_close(model(x), reference(x))
    names = _saved(tmp_path)
    for name in ("torch_exported", "optimized", "execution_model"):
        assert f"my_cwd_model_{name}_inference.onnx" in names, names
        onnx.load(str(tmp_path / f"my_cwd_model_{name}_inference.onnx"))
    upstream_names = ("my_cwd_model_torch_", "my_cwd_model_optimized")
    upstream_training = [n for n in names if n.startswith(upstream_names) and "_training" in n]
    assert upstream_training == []
    # ORT writes the optimized pre-gradient graph only when it builds a gradient graph: in eval() with grad enabled
    # ortcore does (PyTorch computes gradients there too), under no_grad it does not.
    assert ("my_cwd_model_optimized_pre_grad_inference.onnx" in names) is (how == "eval")


def test_saved_graph_file_names_in_the_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    model = ORTModule(Small(), DebugOptions(save_onnx=True, onnx_prefix="cwd"))
    model(torch.randn(3, 4)).sum().backward()
    assert {"cwd_torch_exported_training.onnx", "cwd_optimized_training.onnx"} <= _saved(tmp_path)


# -- registering on an ORTModule acts on the wrapped model -----------------------------------------------------------


class Extensible(nn.Module):
    """Its forward uses whatever direct buffers and parameters it has, and ``activation`` if set."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        for _, buffer in self.named_buffers(recurse=False):
            y = y + buffer
        for _, parameter in self.named_parameters(recurse=False):
            y = y * parameter
        activation = getattr(self, "activation", None)
        return activation(y) if activation is not None else y


def _resets(model: ORTModule) -> list[str]:
    return [t.reason for t in model.state_machine.history if t.action == "reset"]


def test_register_buffer_after_a_step_goes_to_the_model_and_is_fed():
    reference = Extensible()
    model = ORTModule(copy.deepcopy(reference), fallback_policy="FALLBACK_DISABLE")
    step_matches_torch(model, reference, torch.randn(5, 4))
    offset = torch.linspace(-1.0, 1.0, 3)
    model.register_buffer("offset", offset.clone())
    reference.register_buffer("offset", offset.clone())
    assert model.module.offset is dict(model.named_buffers())["offset"]
    assert "offset" not in model._buffers  # not on the wrapper
    assert "offset" in model.state_dict()
    step_matches_torch(model, reference, torch.randn(5, 4))
    assert model.state_machine.counters.exports == 2
    assert any("buffer 'offset'" in reason for reason in _resets(model))
    model.offset.mul_(3.0)  # an in-place change of the buffer is fed on the next step
    reference.offset.mul_(3.0)
    step_matches_torch(model, reference, torch.randn(5, 4))
    assert model.state_machine.counters.exports == 2


def test_register_buffer_non_persistent_stays_out_of_state_dict():
    model = ORTModule(Extensible())
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    assert "scratch" in dict(model.named_buffers())
    assert "scratch" not in model.state_dict()


def test_register_parameter_after_a_step_is_trained_like_pytorch():
    reference = Extensible()
    model = ORTModule(copy.deepcopy(reference), fallback_policy="FALLBACK_DISABLE")
    step_matches_torch(model, reference, torch.randn(5, 4))
    gain = torch.linspace(0.5, 1.5, 3)
    model.register_parameter("gain", nn.Parameter(gain.clone()))
    reference.register_parameter("gain", nn.Parameter(gain.clone()))
    assert "gain" in dict(model.named_parameters())
    assert model.get_parameter("gain") is model.module.gain
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(3):
        step_matches_torch(model, reference, torch.randn(5, 4))  # gain's gradient is compared too
        for opt in optimizers:
            opt.step()
    assert_close(model.module.gain, reference.gain, msg="gain after training")
    assert model.state_machine.counters.exports == 2
    assert any("parameter 'gain'" in reason for reason in _resets(model))


def test_add_module_goes_to_the_model():
    model = ORTModule(Small())
    head = nn.Linear(2, 2)
    model.add_module("head", head)
    assert model.module.head is head
    assert "head" not in model._modules


def test_setting_a_constant_attribute_is_seen_by_the_next_call():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.scale = 1.0

        def forward(self, x):
            return self.fc(x) * self.scale

    reference = Scaled()
    model = ORTModule(copy.deepcopy(reference), fallback_policy="FALLBACK_DISABLE")
    step_matches_torch(model, reference, torch.randn(5, 4))
    model.scale = 3.0
    reference.scale = 3.0
    assert model.module.scale == 3.0
    step_matches_torch(model, reference, torch.randn(5, 4))
    assert model.state_machine.counters.exports == 2
    assert any("attribute 'scale'" in reason for reason in _resets(model))


def test_setting_a_new_method_is_seen_by_the_next_call():
    reference = Extensible()
    model = ORTModule(copy.deepcopy(reference), fallback_policy="FALLBACK_DISABLE")
    step_matches_torch(model, reference, torch.randn(5, 4))

    def activation(self, y):
        return torch.tanh(y) * self.fc.out_features

    model.activation = types.MethodType(activation, model.module)
    reference.activation = types.MethodType(activation, reference)
    assert "activation" in vars(model.module)
    step_matches_torch(model, reference, torch.randn(5, 4))
    assert model.state_machine.counters.exports == 2
    assert any("attribute 'activation' of the model was set" in reason for reason in _resets(model))


def test_setting_an_attribute_to_the_same_object_does_not_export_again():
    model = ORTModule(Small(), fallback_policy="FALLBACK_DISABLE")
    model(torch.randn(3, 4))
    model.fc1 = model.fc1
    model(torch.randn(3, 4))
    assert model.state_machine.counters.exports == 1
    assert _resets(model) == []


# -- ONNX_OPSET_VERSION --------------------------------------------------------------------------------------------


def test_onnx_opset_version_is_upstreams_and_the_default():
    assert ortcore.ONNX_OPSET_VERSION == 17
    assert ORTModule(Small()).runtime_options.opset == ortcore.ONNX_OPSET_VERSION


def test_assigning_onnx_opset_version_sets_the_opset_of_new_models(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setattr(ortcore, "ONNX_OPSET_VERSION", 15)
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    reference = Small()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(save_onnx=True, onnx_prefix="o"))
    assert model.runtime_options.opset == 15
    step_matches_torch(model, reference, torch.randn(5, 4))
    exported = onnx.load(str(tmp_path / "o_torch_exported_training.onnx"))
    assert {e.domain: e.version for e in exported.opset_import}[""] == 15
    assert ORTModule(Small(), opset=16).runtime_options.opset == 16  # the argument wins
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "14")
    assert ORTModule(Small()).runtime_options.opset == 14  # and the environment over both


# -- explain ----------------------------------------------------------------------------------------------------------


def test_explain_returns_ortcore_explain_of_the_model(monkeypatch: pytest.MonkeyPatch):
    seen = []

    def explain(model):
        seen.append(model)
        return "report"

    monkeypatch.setitem(sys.modules, "ortcore.explain", types.SimpleNamespace(explain=explain))
    model = ORTModule(Small())
    assert model.explain() == "report"
    assert seen == [model]
