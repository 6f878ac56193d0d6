"""DebugOptions: saving the ONNX graphs, log levels, and how much the exporter and ORT print at each level."""

from __future__ import annotations

import copy
import os

import onnx
import pytest
import torch
from torch import nn

import ortcore
from ortcore import DebugOptions, LogLevel, ORTModule
from ortcore.testing import make_host

RTOL, ATOL = 1e-4, 1e-5


def assert_close(actual, expected, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class CumMax(nn.Module):
    """Fails to export: ``aten::cummax`` has no symbolic in torch 2.13."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(self.fc(x), dim=1).values


def op_types(model: onnx.ModelProto) -> set[str]:
    return {node.op_type for node in model.graph.node}


def train_step_matches_torch(model: ORTModule, reference: nn.Module) -> None:
    x = torch.randn(5, 4)
    out = model(x)
    expected = reference(x)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=f"gradient of {name}")


# -- saving ONNX ---------------------------------------------------------------------------------------------------


def test_save_onnx_writes_pre_gradient_and_training_models(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    reference = Small()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(save_onnx=True, onnx_prefix="m"))
    train_step_matches_torch(model, reference)
    assert model.state_machine.counters.fallbacks == 0
    pre_grad = onnx.load(str(tmp_path / "m_pre_grad_training.onnx"))
    training = onnx.load(str(tmp_path / "m_training.onnx"))
    assert "Relu" in op_types(pre_grad)
    params = {"fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias"}
    assert {"x"} | params <= {i.name for i in pre_grad.graph.input}
    assert "YieldOp" in op_types(training)  # the forward/backward split
    assert "ReluGrad" in op_types(training)
    assert {o.name for o in training.graph.output} >= {"fc1.weight_grad", "fc2.bias_grad"}
    onnx.checker.check_model(pre_grad)  # the pre-gradient graph is plain ONNX
    assert not list(tmp_path.glob("*.tmp"))


def test_save_onnx_writes_inference_model_in_eval(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    reference = Small().eval()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(save_onnx=True, onnx_prefix="m"))
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert_close(model(x), reference(x))
    names = {p.name for p in tmp_path.iterdir()}
    assert {"m_pre_grad_eval.onnx", "m_inference.onnx"} <= names
    assert "m_training.onnx" not in names
    inference = onnx.load(str(tmp_path / "m_inference.onnx"))
    assert "YieldOp" not in op_types(inference)
    assert "Relu" in op_types(inference)


def test_save_onnx_without_prefix_is_an_option_error():
    with pytest.raises(ortcore.OptionError, match="onnx_prefix"):
        DebugOptions(save_onnx=True)


def test_save_dir_that_is_not_a_directory_raises_oserror_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "onnx"
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(bad))
    with pytest.raises(OSError, match="a_file"):
        ORTModule(Small(), DebugOptions(save_onnx=True, onnx_prefix="m"))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write to read-only directories")
def test_read_only_save_dir_raises_oserror_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(read_only))
    try:
        with pytest.raises(OSError, match="read_only"):
            ORTModule(Small(), DebugOptions(save_onnx=True, onnx_prefix="m"))
    finally:
        read_only.chmod(0o700)


# -- log levels ------------------------------------------------------------------------------------------------------


def test_log_level_names_and_values():
    assert {level.name: level.value for level in LogLevel} == {
        "VERBOSE": 0,
        "DEVINFO": 1,
        "INFO": 2,
        "WARNING": 3,
        "ERROR": 4,
        "FATAL": 5,
    }
    assert DebugOptions().log_level == LogLevel.WARNING
    assert DebugOptions(log_level="info").log_level == LogLevel.INFO


def test_bad_debug_options_log_level_is_an_option_error():
    with pytest.raises(ortcore.OptionError, match="LOUD"):
        DebugOptions(log_level="LOUD")


def test_warning_level_keeps_exporter_and_ort_silent(capfd: pytest.CaptureFixture):
    reference = Small()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(log_level=LogLevel.WARNING))
    train_step_matches_torch(model, reference)
    model.eval()
    reference.eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert_close(model(x), reference(x))
    out, err = capfd.readouterr()
    assert out == ""
    assert err == ""


def test_warning_level_failed_export_prints_no_exporter_dump(capfd: pytest.CaptureFixture):
    reference = CumMax()
    host = make_host({}, env=os.environ)  # the core alone cannot export cummax (ATen-routing plugins could)
    model = ORTModule(copy.deepcopy(reference), DebugOptions(log_level=LogLevel.WARNING), host=host)
    with pytest.warns(RuntimeWarning, match="aten::cummax"):
        x = torch.randn(3, 4)
        assert_close(model(x), reference(x))
    out, err = capfd.readouterr()
    assert out == ""
    assert "Torch IR graph" not in err
    assert "graph(" not in err


def test_verbose_level_shows_exporter_output(capfd: pytest.CaptureFixture):
    reference = Small()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(log_level=LogLevel.VERBOSE))
    try:
        train_step_matches_torch(model, reference)
    finally:
        ORTModule(nn.Linear(2, 2), DebugOptions(log_level=LogLevel.WARNING))  # back to the quiet default
    out, err = capfd.readouterr()
    text = out + err
    assert "graph(" in text or "Exported graph" in text, text[:2000]
