"""compute_optimizer: ORT's compute optimizer is on by default, off by option, and off (ORT's default) without the
plugin; when on, ORT's UpStreamGather visibly moves a slice up the graph and gradients still match PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from models import (
    assert_ran_in_ort,
    bert_batch,
    check_step_and_training,
    hf_step,
    make_batches,
    ort_and_torch,
    tiny_bert,
)
from onnxruntime.capi import _pybind_state as C
from torch import nn

import ortcore_plugins.compute_optimizer as plugin
from ortcore import DebugOptions
from ortcore.errors import OptionError
from ortcore.host import PluginHost
from ortcore.testing import assert_matches_torch

ENV = "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"
HostFactory = Callable[..., PluginHost]


class FirstTokenHead(nn.Module):
    """``head(gelu(enc(x))[:, 0])``: the first-token slice ORT's UpStreamGather can move above ``enc``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.enc(x))[:, 0])


def transformer_config(host: PluginHost, preset: bool | None = None) -> Any:
    """A fresh ``TrainingGraphTransformerConfiguration`` after the host's plugins adjusted it."""
    config = C.TrainingGraphTransformerConfiguration()
    if preset is not None:
        config.enable_compute_optimizer = preset
    host.hooks.graph_transformer_config(config, training=True)
    return config


def gather_source(tmp_path: Path, prefix: str) -> str:
    """What the first-token Gather of the saved training graph reads: a graph input's name or a node's op type."""
    model = onnx.load(str(tmp_path / f"{prefix}_training.onnx"))
    producer = {out: node for node in model.graph.node for out in node.output}
    gathers = [n for n in model.graph.node if n.op_type == "Gather"]
    assert len(gathers) == 1, [n.name for n in gathers]
    data = gathers[0].input[0]
    return producer[data].op_type if data in producer else data


def run_first_token_head(host: PluginHost, tmp_path: Path, prefix: str) -> None:
    model = FirstTokenHead()
    debug = DebugOptions(save_onnx=True, onnx_prefix=prefix, save_path=str(tmp_path))
    wrapped = assert_matches_torch(model, (torch.randn(4, 6, 8),), host=host, debug_options=debug)
    assert_ran_in_ort(wrapped)


# -- the switch -----------------------------------------------------------------------------------------------------


def test_ort_default_is_off() -> None:
    # The core passes a default-constructed configuration: without this plugin the compute optimizer is off.
    assert C.TrainingGraphTransformerConfiguration().enable_compute_optimizer is False


@pytest.mark.parametrize(
    ("table", "env", "expected"),
    [
        ({}, {}, True),
        ({}, {ENV: "0"}, False),
        ({}, {ENV: "1"}, True),
        ({"enable": False}, {}, False),
        ({"enable": False}, {ENV: "1"}, True),  # the environment wins over the file
        ({"enable": True}, {ENV: "off"}, False),
    ],
)
def test_option_sets_ort_switch(ortcore_host: HostFactory, table: dict, env: dict, expected: bool) -> None:
    host = ortcore_host({"compute_optimizer": plugin}, table={"plugins": {"compute_optimizer": table}}, env=env)
    assert transformer_config(host).enable_compute_optimizer is expected


def test_option_off_is_set_explicitly(ortcore_host: HostFactory) -> None:
    host = ortcore_host({"compute_optimizer": plugin}, env={ENV: "0"})
    assert transformer_config(host, preset=True).enable_compute_optimizer is False


def test_without_plugin_config_keeps_ort_default(ortcore_host: HostFactory) -> None:
    assert transformer_config(ortcore_host({})).enable_compute_optimizer is False


def test_bad_value_names_variable(ortcore_host: HostFactory) -> None:
    with pytest.raises(OptionError, match=f"{ENV}='maybe' is not a boolean"):
        ortcore_host({"compute_optimizer": plugin}, env={ENV: "maybe"})


def test_unknown_key_suggests_enable(ortcore_host: HostFactory) -> None:
    with pytest.raises(OptionError, match="Did you mean 'enable'"):
        ortcore_host({"compute_optimizer": plugin}, table={"plugins": {"compute_optimizer": {"enabled": True}}})


# -- the graph ORT builds ----------------------------------------------------------------------------------------


def test_upstream_gather_moves_slice_to_input(ortcore_host: HostFactory, tmp_path: Path) -> None:
    run_first_token_head(ortcore_host({"compute_optimizer": plugin}), tmp_path, "on")
    run_first_token_head(ortcore_host({"compute_optimizer": plugin}, env={ENV: "0"}), tmp_path, "off")
    run_first_token_head(ortcore_host({}), tmp_path, "disabled")
    # On: the slice runs on the input, so enc and gelu see one token per row instead of six.
    assert gather_source(tmp_path, "on") == "x"
    assert gather_source(tmp_path, "off") == "Gelu"
    assert gather_source(tmp_path, "disabled") == "Gelu"


class LogitsAndLoss(nn.Module):
    """A causal LM's tail: ``logits = head(h)`` is returned and also flattened for the loss (``[B*S, V]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 12)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(h).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)), logits


def test_a_graph_output_the_graph_also_reshapes_keeps_its_shape(ortcore_host: HostFactory) -> None:
    """On static sizes UpStreamReshape gave ``logits`` the loss input's ``[B*S, V]`` shape: the backward failed adding
    the user's ``[B, S, V]`` gradient. ``shield_graph_outputs`` keeps it: one graph, outputs and every gradient (of
    the loss and of the logits) as PyTorch's."""
    torch.manual_seed(0)
    model = LogitsAndLoss()
    ort, ref = ort_and_torch(
        model, host=ortcore_host({"compute_optimizer": plugin}, env={"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"})
    )
    h, labels = torch.randn(3, 5, 8), torch.randint(0, 12, (3, 5))
    (loss, logits), (loss_ref, logits_ref) = ort(h, labels), ref(h, labels)
    assert logits.shape == (3, 5, 12)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-5)
    weights = torch.randn(3, 5, 12)
    (loss + (logits * weights).sum()).backward()
    (loss_ref + (logits_ref * weights).sum()).backward()
    for (name, p), q in zip(ort.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert ort.state_machine.counters.exports == 1  # the static graph itself, not the dynamic one after a failure
    graph = ort.state_machine.current[0].model.graph
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim] == [3, 5, 8]


def test_shield_graph_outputs_gives_each_output_the_graph_reads_an_identity() -> None:
    import onnx.helper as h

    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])
    z = h.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [6])
    model = h.make_model(
        h.make_graph(
            [h.make_node("Relu", ["x"], ["y"]), h.make_node("Flatten", ["y"], ["z"], axis=0)],
            "g",
            [x],
            [y, z, x],  # y is read by Flatten; z is not; x is an input passed through
        )
    )
    plugin.shield_graph_outputs(model)
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert nodes == [
        ("Relu", ["x"], ["y_before_output"]),
        ("Flatten", ["y_before_output"], ["z"]),
        ("Identity", ["y_before_output"], ["y"]),
    ]
    onnx.checker.check_model(model)


def test_bert_trains_like_torch(ortcore_host: HostFactory) -> None:
    ort, ref = ort_and_torch(tiny_bert(), host=ortcore_host({"compute_optimizer": plugin}))
    check_step_and_training(ort, ref, make_batches(bert_batch, 4), hf_step, steps=3)


def test_a_failure_inside_the_compute_optimizer_is_repaired_by_switching_it_off(ortcore_host):
    from ortcore.repair import Failure

    host = ortcore_host({"compute_optimizer": plugin})
    crash = Failure("build", "RuntimeError: upstream_gather_actors.cc:51 CreateNewShapeWithUpdatedDim: not static")
    (repair,) = host.hooks.repairs(crash)
    assert (repair.kind, repair.plugin, dict(repair.options)) == ("switch", "compute_optimizer", {"enable": False})
    switched = host.with_plugin_options({repair.plugin: repair.options})
    assert switched.config.plugin_options("compute_optimizer").enable is False
    assert host.hooks.repairs(Failure("build", "GradientBuilder not registered for op Softplus")) == []
    assert host.hooks.repairs(Failure("export", "upstream_gather_actors.cc")) == []  # not its stage


class NormReturned(nn.Module):
    """A LayerNorm's output returned and also read: with LayerNorm on PyTorch's kernel it is an ATen node's output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)  # the norm's input needs a gradient: then it runs on PyTorch's kernel
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.inp(x))
        return h, self.head(h)


def test_a_shielded_output_of_an_aten_node_keeps_its_type(ortcore_host: HostFactory) -> None:
    """ORT cannot infer an ATen node's output type: the renamed value keeps the graph output's (the build failed
    with "type inference failed" before)."""
    import ortcore_plugins.aten_fallback as aten

    torch.manual_seed(0)
    host = ortcore_host(
        {"compute_optimizer": plugin, "aten_fallback": aten}, env={"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}
    )
    ort, ref = ort_and_torch(NormReturned(), host=host)
    x = torch.randn(4, 5, 8)
    (h, y), (h_ref, y_ref) = ort(x), ref(x)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-5)
    (h.square().sum() + y.sum()).backward()
    (h_ref.square().sum() + y_ref.sum()).backward()
    for (name, p), q in zip(ort.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert any(n.op_type == "ATen" for n in ort.state_machine.current[0].model.graph.node)
