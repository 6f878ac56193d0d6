"""sparse_optimizer: padded labels make ORT gather the valid rows before the loss, with PyTorch's numbers; embedding
sparsity changes nothing on this CPU build; the switches combine as documented.

The graph checks save the gradient graph ORT built (``<prefix>_training.onnx``) with the option on and off and
compare node types. The benchmark at the end (``-m slow``) measures the step time of a small GPT-2.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from models import (
    assert_grads_match,
    assert_losses_match,
    assert_ran_in_ort,
    check_step_and_training,
    gpt2_batch,
    hf_step,
    make_batches,
    ort_and_torch,
    tiny_gpt2,
)
from onnx import TensorProto, helper
from torch import nn

import ortcore_plugins.compute_optimizer as compute_optimizer
import ortcore_plugins.sparse_optimizer as plugin
from ortcore import DebugOptions, ORTModule
from ortcore.errors import OptionError
from ortcore.graph_passes import PassContext
from ortcore.host import PluginHost

LABEL = "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER"
EMBEDDING = "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER"
SPARSE = "ORTMODULE_ENABLE_SPARSE_OPTIMIZER"
COMPUTE = "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"
HostFactory = Callable[..., PluginHost]
PLUGINS = {"sparse_optimizer": plugin, "compute_optimizer": compute_optimizer}


class PaddedLM(nn.Module):
    """A language-model head whose loss flattens the logits as nanoGPT does: ``view(-1, logits.size(-1))``."""

    def __init__(self, vocab: int = 40, dim: int = 16, padding_idx: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(F.gelu(self.mix(self.embed(ids))))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class TwoHeads(nn.Module):
    """Two losses on the same labels."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 10)
        self.b = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.a(x), labels) + F.cross_entropy(self.b(x), labels, reduction="sum")


def padded_batch(batch: int = 4, seq: int = 8, vocab: int = 40, valid: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels whose last ``seq - valid`` positions of each row are ignore_index (-100)."""
    ids = torch.randint(1, vocab, (batch, seq))
    labels = ids.clone()
    labels[:, valid:] = -100
    return ids, labels


def debug(tmp_path: Path, prefix: str) -> DebugOptions:
    return DebugOptions(save_onnx=True, onnx_prefix=prefix, save_path=str(tmp_path))


def op_types(tmp_path: Path, name: str) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(tmp_path / f"{name}.onnx")).graph.node)


def host_with(ortcore_host: HostFactory, env: dict[str, str] | None = None, **kwargs: Any) -> PluginHost:
    """Both plugins; label sparsity switched on unless ``env`` is given (it is off by default on CPU)."""
    return ortcore_host(PLUGINS, env={LABEL: "1"} if env is None else env, **kwargs)


def run_and_compare(model: nn.Module, args: tuple, host: PluginHost, **kwargs: Any) -> None:
    """One step in ortcore and in PyTorch from the same weights: loss and every gradient must match."""
    ort, ref = ort_and_torch(model, host=host, **kwargs)
    loss, loss_ref = ort(*args), ref(*args)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert_ran_in_ort(ort)


# -- options --------------------------------------------------------------------------------------------------------


def test_defaults_label_off_embedding_off(ortcore_host: HostFactory) -> None:
    switches = plugin.resolve(host_with(ortcore_host, {}).config)
    assert (switches.label_requested, switches.embedding_requested, switches.compute_optimizer) == (False, False, True)
    assert not switches.label


@pytest.mark.parametrize(
    ("table", "env", "expected"),
    [
        ({}, {SPARSE: "0"}, (False, False)),
        ({}, {SPARSE: "1"}, (True, True)),
        ({}, {EMBEDDING: "1"}, (False, True)),
        ({}, {SPARSE: "0", LABEL: "1"}, (True, False)),  # a specific variable beats the older one
        ({"label": True}, {SPARSE: "0"}, (False, False)),  # the environment beats the file
        ({"enable": False, "label": True}, {}, (True, False)),  # same level: the specific key wins
        ({"enable": True}, {}, (True, True)),
        ({"enable": False}, {LABEL: "1"}, (True, False)),
    ],
)
def test_older_switch_precedence(ortcore_host: HostFactory, table: dict, env: dict, expected: tuple) -> None:
    host = host_with(ortcore_host, env, table={"plugins": {"sparse_optimizer": table}})
    switches = plugin.resolve(host.config)
    assert (switches.label_requested, switches.embedding_requested) == expected


@pytest.mark.parametrize(
    ("plugins", "env"),
    [(PLUGINS, {COMPUTE: "0", LABEL: "1"}), ({"sparse_optimizer": plugin}, {LABEL: "1"})],
    ids=["compute-optimizer-off", "compute-optimizer-disabled"],
)
def test_label_sparsity_needs_compute_optimizer(ortcore_host: HostFactory, plugins: dict, env: dict) -> None:
    host = ortcore_host(plugins, env=env)
    switches = plugin.resolve(host.config)
    assert switches.label_requested and not switches.label
    assert host.hooks.graph_passes() == []
    assert host.hooks.export_key() == {"sparse_optimizer.label": False}


def test_export_key_follows_label_switch(ortcore_host: HostFactory) -> None:
    assert host_with(ortcore_host).hooks.export_key() == {"sparse_optimizer.label": True}
    assert host_with(ortcore_host, {LABEL: "0"}).hooks.export_key() == {"sparse_optimizer.label": False}


def test_bad_value_names_variable(ortcore_host: HostFactory) -> None:
    with pytest.raises(OptionError, match=f"{LABEL}='2' is not a boolean"):
        host_with(ortcore_host, {LABEL: "2"})


def test_embedding_switch_warns_it_has_no_effect(ortcore_host: HostFactory, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ortcore.sparse_optimizer"):
        host_with(ortcore_host, {EMBEDDING: "1"})
    assert "CUDA/ROCm" in caplog.text and "no effect" in caplog.text


# -- the training graph ORT builds ------------------------------------------------------------------------------


def test_padded_labels_gather_valid_rows_before_loss(ortcore_host: HostFactory, tmp_path: Path) -> None:
    ids, labels = padded_batch()
    run_and_compare(PaddedLM(), (ids, labels), host_with(ortcore_host), debug_options=debug(tmp_path, "on"))
    run_and_compare(
        PaddedLM(), (ids, labels), host_with(ortcore_host, {LABEL: "0"}), debug_options=debug(tmp_path, "off")
    )

    marked, on, off = (
        op_types(tmp_path, "on_pre_grad_training"),
        op_types(tmp_path, "on_training"),
        op_types(tmp_path, "off_training"),
    )
    assert marked["PythonOp"] == 1 and marked["SoftmaxCrossEntropyLossInternal"] == 1
    # ORT found the marker, removed it, and gathered logits and labels of the valid rows before the loss.
    assert on["ShrunkenGather"] == 2 and on["NonZero"] == 1 and on["PythonOp"] == 0
    assert on["SoftmaxCrossEntropyLossInternalGrad"] == 1
    assert off["ShrunkenGather"] == 0 and off["NonZero"] == 0 and off["SoftmaxCrossEntropyLoss"] == 1


def test_sum_reduction_and_shared_labels_match_torch(ortcore_host: HostFactory, tmp_path: Path) -> None:
    labels = torch.randint(0, 10, (12,))
    labels[5:] = -100
    run_and_compare(
        TwoHeads(), (torch.randn(12, 8), labels), host_with(ortcore_host), debug_options=debug(tmp_path, "two")
    )
    assert op_types(tmp_path, "two_training")["PythonOp"] == 0


def test_all_labels_ignored_gives_zero_loss(ortcore_host: HostFactory) -> None:
    # ORT's CPU loss kernels divide by the row count: without the plugin's guard, zero gathered rows end the process.
    ids, labels = padded_batch(valid=0)
    # 0 where PyTorch gives NaN, on purpose: the audit, which would rightly call that a difference, is off.
    host = host_with(ortcore_host, env={LABEL: "1", "ORTCORE_VERIFY_GRADIENTS": "0"})
    ort, ref = ort_and_torch(PaddedLM(), host=host)
    loss = ort(ids, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(p.grad) == 0 for p in ort.parameters() if p.grad is not None)
    assert torch.isnan(ref(ids, labels))  # PyTorch's mean over no label is 0/0; ORT without the plugin gives 0


def test_no_grad_in_training_mode_runs_without_marker(ortcore_host: HostFactory, tmp_path: Path) -> None:
    ids, labels = padded_batch()
    ort, ref = ort_and_torch(PaddedLM(), host=host_with(ortcore_host), debug_options=debug(tmp_path, "lm"))
    ort(ids, labels).backward()  # the training-mode export carries the marker
    with torch.no_grad():
        assert_losses_match(ort(ids, labels), ref(ids, labels))
    inference = op_types(tmp_path, "lm_inference")
    assert inference["PythonOp"] == 0 and inference["SoftmaxCrossEntropyLossInternal"] == 1
    assert_ran_in_ort(ort, exports=1)


def test_eval_export_is_not_marked(ortcore_host: HostFactory, tmp_path: Path) -> None:
    ids, labels = padded_batch()
    run_and_compare(PaddedLM().eval(), (ids, labels), host_with(ortcore_host), debug_options=debug(tmp_path, "ev"))
    assert op_types(tmp_path, "ev_pre_grad_eval")["PythonOp"] == 0
    assert op_types(tmp_path, "ev_training")["ShrunkenGather"] == 0


def test_gpt2_trains_like_torch(ortcore_host: HostFactory, tmp_path: Path) -> None:
    def batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
        b = gpt2_batch(gen, batch=3, seq=12)
        b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
        return b

    ort, ref = ort_and_torch(tiny_gpt2(), host=host_with(ortcore_host), debug_options=debug(tmp_path, "gpt2"))
    check_step_and_training(ort, ref, make_batches(batch, 4), hf_step, steps=3)
    assert op_types(tmp_path, "gpt2_training")["ShrunkenGather"] == 2


def test_padded_embedding_changes_nothing_on_cpu(ortcore_host: HostFactory, tmp_path: Path) -> None:
    ids, labels = padded_batch()
    ids[:, 4:] = 0  # the padding token
    for name, env in (("on", {EMBEDDING: "1", LABEL: "0"}), ("off", {EMBEDDING: "0", LABEL: "0"})):
        run_and_compare(
            PaddedLM(padding_idx=0), (ids, labels), host_with(ortcore_host, env), debug_options=debug(tmp_path, name)
        )
    nodes = {
        name: [n.op_type for n in onnx.load(str(tmp_path / f"{name}_training.onnx")).graph.node]
        for name in ("on", "off")
    }
    assert nodes["on"] == nodes["off"]


# -- the pass on hand-made graphs -------------------------------------------------------------------------------


def loss_graph(reduction: str = "mean", classes: int | None = 5, ignore_index: int | None = -100) -> onnx.ModelProto:
    attributes: dict[str, Any] = {"reduction": reduction}
    if ignore_index is not None:
        attributes["ignore_index"] = ignore_index
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], **attributes)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", classes if classes else "c"]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, ["n"]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def flagged(model: onnx.ModelProto, training: bool = True) -> Counter:
    plugin.flag_label_sparsity(model, PassContext(module=None, training=training, config=None))
    return Counter(n.op_type for n in model.graph.node)


def test_pass_marks_eligible_loss() -> None:
    model = loss_graph()
    nodes = flagged(model)
    assert (
        nodes["PythonOp"] == 1
        and nodes["SoftmaxCrossEntropyLossInternal"] == 1
        and nodes["SoftmaxCrossEntropyLoss"] == 0
    )
    assert model.graph.node[-1].output[0] == "loss"  # the graph's output keeps its name
    onnx.checker.check_model(plugin.strip_markers(model))


@pytest.mark.parametrize(
    "model",
    [loss_graph(reduction="none"), loss_graph(classes=None), loss_graph(ignore_index=None)],
    ids=["reduction-none", "unknown-classes", "no-ignore-index"],
)
def test_pass_leaves_ineligible_loss(model: onnx.ModelProto) -> None:
    assert flagged(model) == Counter({"SoftmaxCrossEntropyLoss": 1})


def test_pass_leaves_eval_export() -> None:
    assert flagged(loss_graph(), training=False) == Counter({"SoftmaxCrossEntropyLoss": 1})


def test_pass_reports_aten_cross_entropy(caplog: pytest.LogCaptureFixture) -> None:
    node = helper.make_node(
        "ATen", ["x", "y"], ["loss"], domain="org.pytorch.aten", operator="ortcore_aten::cross_entropy"
    )
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    with caplog.at_level(logging.INFO, logger="ortcore.sparse_optimizer"):
        assert flagged(model) == Counter({"ATen": 1})
    assert "aten_fallback" in caplog.text


# -- benchmark ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_label_sparsity_step_time(ortcore_host: HostFactory, capsys: pytest.CaptureFixture) -> None:
    """Small GPT-2 (batch 8 x seq 128, hidden 256, 4 layers, vocabulary 8000), half of each row's labels padded.

    Each round runs one training step (forward, backward, AdamW) of every variant, in rotating order, so that load
    from other processes on the machine hits all variants alike. Printed per variant: the median wall time and
    process CPU time of the steps after warm-up, and the median per-round ratio to "label off" of each. Losses must
    agree with PyTorch's at every step.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    batch, seq, hidden, layers, vocab, warmup, steps = 8, 128, 256, 4, 8000, 3, 30
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=hidden // 64,
        bos_token_id=0,
        eos_token_id=0,
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    base = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids.masked_fill(torch.arange(seq) >= seq // 2, -100)}

    variants: dict[str, dict[str, str] | None] = {
        "label on (default)": {},
        "label off": {LABEL: "0"},
        "compute optimizer off": {COMPUTE: "0"},
        "PyTorch eager": None,
    }
    runs = {}
    for name, env in variants.items():
        model = copy.deepcopy(base)
        if env is not None:
            model = ORTModule(model, host=host_with(ortcore_host, env), fallback_policy="FALLBACK_DISABLE")
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(warmup + steps):
        names = list(runs)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            model, optimizer = runs[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
            losses[name].append(loss.item())
    for name in runs:
        for a, e in zip(losses[name], losses["PyTorch eager"]):
            assert abs(a - e) <= 1e-4 * abs(e), (name, losses[name], losses["PyTorch eager"])

    def ratio(times: dict[str, list[float]], name: str) -> float:
        return statistics.median(t / o for t, o in zip(times[name], times["label off"]))

    with capsys.disabled():
        print(f"\nGPT-2 {batch}x{seq}, hidden {hidden}, {layers} layers, vocabulary {vocab}, 50% labels padded")
        for name in runs:
            print(
                f"  {name:22s} wall {statistics.median(wall[name]) * 1e3:7.1f} ms (x{ratio(wall, name):.3f})"
                f"   cpu {statistics.median(cpu[name]) * 1e3:7.1f} ms (x{ratio(cpu, name):.3f})"
            )
