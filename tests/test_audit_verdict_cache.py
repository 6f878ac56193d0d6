"""Passed audit verdicts recorded beside the export cache (``ortcore_plugins.gradient_audit.verdicts``).

A second model of the same graph, on a host with the same cache directory, takes the recorded verdict instead of
auditing; anything that changes what ONNX Runtime computes (a forward graph pass, a gradient-graph pass the export
fingerprint does not see) is audited again and a planted wrong gradient is caught; a garbled or foreign verdict file
is ignored and written again; a mismatch is never recorded; removing the verdicts' directory audits again.
"""

from __future__ import annotations

import copy
import json
import os
import types
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from torch import nn

import ortcore_plugins.export_cache as export_cache
from ortcore import GradientMismatchError, ORTModule
from ortcore.graph_passes import GraphPass
from ortcore.hookspecs import hookimpl
from ortcore.testing import make_host
from ortcore_plugins.gradient_audit import verdicts


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _env(cache: Path, **extra: str) -> dict[str, str]:
    return {"ORTMODULE_CACHE_DIR": str(cache), "ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE", **extra}


def _step(model: nn.Module, host: Any) -> Any:
    """One audited training step; the audit's result."""
    wrapped = ORTModule(model, verify_gradients=True, host=host)
    torch.manual_seed(3)
    wrapped(torch.randn(5, 6)).square().mean().backward()
    assert len(wrapped.gradient_audits) == 1, wrapped.gradient_audits
    return wrapped.gradient_audits[0]


def _verdicts_dir(cache: Path) -> Path:
    return cache.with_name(cache.name + verdicts.SUFFIX)


def _verdict_files(cache: Path) -> list[Path]:
    directory = _verdicts_dir(cache)
    return sorted(directory.glob("*.json")) if directory.is_dir() else []


def _hosts(cache: Path, plugins: dict | None = None, **extra: str) -> Any:
    return make_host({"export_cache": export_cache, **(plugins or {})}, env=_env(cache, **extra))


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def test_a_second_model_of_the_same_graph_takes_the_recorded_verdict(tmp_path: Path, model: nn.Module) -> None:
    first = _step(copy.deepcopy(model), _hosts(tmp_path / "cache"))
    assert first.status == "passed" and not first.recorded
    (file,) = _verdict_files(tmp_path / "cache")
    record = json.loads(file.read_text())
    assert record["status"] == "passed" and record["key"] == file.stem and record["compared"] == first.compared
    second = _step(copy.deepcopy(model), _hosts(tmp_path / "cache"))
    assert second.status == "passed"
    assert second.recorded == str(file)
    assert second.compared == first.compared and second.worst.name == first.worst.name
    assert "recorded by an earlier audit" in second.message()
    # The export cache's directory holds its entries only; the verdicts live beside it.
    assert all(p.suffix in (".ortgraph", ".ortsession") for p in (tmp_path / "cache").iterdir())
    assert file.parent == tmp_path / "cache.audit-verdicts"


def _scale_fc1_gemm(graph: onnx.ModelProto, context: Any) -> None:
    """A wrong forward: fc1's Gemm output times 1.01."""
    nodes = list(graph.graph.node)
    index, node = next((i, n) for i, n in enumerate(nodes) if n.op_type == "Gemm" and "fc1" in n.name)
    _scale_value(graph, nodes, index, node.output[0])


def _scale_fc1_weight_gradient(graph: onnx.ModelProto, context: Any) -> None:
    """A wrong gradient after ORT's gradient build: fc1.weight's gradient times 1.01 (the export is unchanged)."""
    nodes = list(graph.graph.node)
    index, _ = next((i, n) for i, n in enumerate(nodes) if "fc1.weight_grad" in n.output)
    _scale_value(graph, nodes, index, "fc1.weight_grad")


def _scale_value(graph: onnx.ModelProto, nodes: list, index: int, value: str) -> None:
    producer = nodes[index]
    producer.output[list(producer.output).index(value)] = value + "_unscaled"
    scale = onnx.helper.make_node(
        "Constant", [], [value + "_scale"], value=onnx.helper.make_tensor("s", onnx.TensorProto.FLOAT, [], [1.01])
    )
    mul = onnx.helper.make_node("Mul", [value + "_unscaled", value + "_scale"], [value], name=f"planted/{value}")
    del graph.graph.node[:]
    graph.graph.node.extend([*nodes[: index + 1], scale, mul, *nodes[index + 1 :]])


@pytest.mark.parametrize(
    "hook, planted",
    [("ortcore_graph_passes", _scale_fc1_gemm), ("ortcore_gradient_graph_passes", _scale_fc1_weight_gradient)],
    ids=["wrong-forward", "wrong-gradient-after-the-build"],
)
def test_a_planted_wrong_graph_is_audited_and_caught_despite_a_recorded_verdict(
    tmp_path: Path, model: nn.Module, hook: str, planted: Any
) -> None:
    assert _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).status == "passed"
    assert len(_verdict_files(tmp_path / "cache")) == 1
    plugin = types.SimpleNamespace(**{hook: hookimpl(lambda: [GraphPass("planted", run=planted)])})
    wrapped = ORTModule(copy.deepcopy(model), verify_gradients=True, host=_hosts(tmp_path / "cache", {"planted": plugin}))
    with pytest.raises(GradientMismatchError) as caught:
        # A wrong forward is caught at the first call; a wrong gradient in the first step's backward, which takes
        # PyTorch's gradients, and the second call, audited by a step of its own, raises.
        for _ in range(2):
            torch.manual_seed(3)
            wrapped(torch.randn(5, 6)).square().mean().backward()
    assert caught.value.result.status == "mismatch" and not caught.value.result.recorded
    assert any(d.name == "fc1.weight" for d in caught.value.result.differences)
    assert len(_verdict_files(tmp_path / "cache")) == 1  # a mismatch is never recorded


@pytest.mark.parametrize(
    "garbage",
    [b"", b"{not json", b"\xff\xfe", b"[]", b'{"format": 1, "key": "another", "status": "passed"}', b"x" * 70000],
    ids=["empty", "truncated", "binary", "a-list", "another-key", "too-large"],
)
def test_a_garbled_verdict_is_ignored_and_written_again(tmp_path: Path, model: nn.Module, garbage: bytes) -> None:
    assert _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).status == "passed"
    (file,) = _verdict_files(tmp_path / "cache")
    good = json.loads(file.read_text())
    file.write_bytes(garbage)
    again = _step(copy.deepcopy(model), _hosts(tmp_path / "cache"))
    assert again.status == "passed" and not again.recorded  # audited
    assert json.loads(file.read_text())["key"] == good["key"]
    assert _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).recorded == str(file)


def test_a_verdict_with_a_wrong_field_is_ignored(tmp_path: Path, model: nn.Module) -> None:
    assert _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).status == "passed"
    (file,) = _verdict_files(tmp_path / "cache")
    record = json.loads(file.read_text())
    file.write_text(json.dumps({**record, "worst": {"kind": 1}}))
    assert not _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).recorded


def test_removing_the_verdicts_directory_audits_again(tmp_path: Path, model: nn.Module) -> None:
    import shutil

    assert _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).status == "passed"
    shutil.rmtree(_verdicts_dir(tmp_path / "cache"))
    again = _step(copy.deepcopy(model), _hosts(tmp_path / "cache"))
    assert again.status == "passed" and not again.recorded
    assert len(_verdict_files(tmp_path / "cache")) == 1


def test_recorded_verdicts_switched_off_neither_read_nor_written(tmp_path: Path, model: nn.Module) -> None:
    cache = tmp_path / "cache"
    off = {"ORTCORE_AUDIT_RECORDED_VERDICTS": "0"}
    assert _step(copy.deepcopy(model), _hosts(cache, **off)).status == "passed"
    assert _verdict_files(cache) == []  # not written
    assert _step(copy.deepcopy(model), _hosts(cache)).status == "passed"
    assert len(_verdict_files(cache)) == 1
    again = _step(copy.deepcopy(model), _hosts(cache, **off))
    assert again.status == "passed" and not again.recorded  # not read: audited again


def test_a_bad_recorded_verdicts_value_is_refused_naming_it() -> None:
    with pytest.raises(Exception, match="ORTCORE_AUDIT_RECORDED_VERDICTS"):
        _hosts(Path("unused"), ORTCORE_AUDIT_RECORDED_VERDICTS="maybe").config.plugin_options("gradient_audit")


def test_a_graph_whose_fingerprint_was_not_seen_is_always_audited(tmp_path: Path, model: nn.Module) -> None:
    assert verdicts.fingerprint_of(object()) is None
    store = verdicts.VerdictStore(tmp_path / "v")
    request = types.SimpleNamespace(graph=object())
    assert verdicts.verdict_key(request) is None
    assert not store.directory.exists()


def test_nothing_is_recorded_without_an_export_cache_directory(tmp_path: Path, model: nn.Module) -> None:
    host = make_host({"export_cache": export_cache}, env={"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"})
    assert _step(copy.deepcopy(model), host).status == "passed"
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_a_directory_others_can_write_to_is_not_trusted(tmp_path: Path, model: nn.Module) -> None:
    assert _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).status == "passed"
    directory = _verdicts_dir(tmp_path / "cache")
    directory.chmod(0o777)
    assert not _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).recorded
    directory.chmod(0o700)
    assert _step(copy.deepcopy(model), _hosts(tmp_path / "cache")).recorded
