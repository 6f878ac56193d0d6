"""efficient_attention: the attention pattern becomes PyTorch's fused CPU kernel, with PyTorch's numbers.

BERT and GPT-2 (Hugging Face's eager and sdpa attention, with and without padding) match eager PyTorch in outputs,
loss, every gradient and an AdamW loss curve, and every layer's attention was replaced (the saved training graph has
no Softmax left); then a hand-written attention, the cases the pass must leave alone, the switch and its options.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from models import (
    assert_grads_match,
    assert_losses_match,
    assert_outputs_match,
    bert_batch,
    check_step_and_training,
    gpt2_batch,
    hf_step,
    make_batches,
    ort_and_torch,
    tiny_bert,
    tiny_gpt2,
)
from torch import nn

import ortcore_plugins.aten_fallback as aten_fallback
import ortcore_plugins.efficient_attention as plugin
from ortcore import DebugOptions
from ortcore.config import Config
from ortcore.errors import OptionError
from ortcore.host import PluginHost

STEPS = 5
LAYERS = 2  # tiny_bert and tiny_gpt2 have two layers, each with one attention


def make_host(enable: bool | None = True, env: dict[str, str] | None = None, with_aten_fallback: bool = False):
    """A host with this plugin (and aten_fallback if asked); ``enable`` None leaves the option at its default."""
    table = {"plugins": {plugin.NAME: {"enable": enable}}} if enable is not None else {}
    plugins: dict[str, Any] = {plugin.NAME: plugin}
    if with_aten_fallback:
        plugins["aten_fallback"] = aten_fallback
    return PluginHost(Config.from_table(table, env=env or {}), autoload=False, plugins=plugins)


def wrap_saving(model: nn.Module, tmp_path: Path, prefix: str, **host_kwargs: Any):
    """``(ORTModule, reference copy)`` whose graphs are saved as ``tmp_path/<prefix>_*.onnx``."""
    debug = DebugOptions(save_onnx=True, onnx_prefix=prefix, save_path=str(tmp_path))
    return ort_and_torch(model, host=make_host(**host_kwargs), debug_options=debug)


def graph_ops(path: Path) -> Counter:
    """Op types of a saved graph, ATen nodes counted by their operator (``ATen:<operator>``)."""
    counts: Counter = Counter()
    for n in onnx.load(str(path)).graph.node:
        if n.op_type == "ATen":
            counts["ATen:" + next(a.s.decode() for a in n.attribute if a.name == "operator")] += 1
        else:
            counts[n.op_type] += 1
    return counts


def assert_all_attention_fused(path: Path, layers: int = LAYERS) -> None:
    """Every attention of the saved training graph runs the fused kernel, forward and backward; no softmax is left."""
    ops = graph_ops(path)
    assert ops[f"ATen:{plugin.FORWARD_OP}"] == layers, ops
    assert ops[f"ATen:{plugin.BACKWARD_OP}"] == layers, ops
    assert not {"Softmax", "SoftmaxGrad_13", "SoftmaxGrad"} & set(ops), ops
    report = plugin.last_report()
    assert report is not None and report.replaced == layers, report


def gpt2_labels(model: nn.Module, batch: dict) -> tuple[Any, torch.Tensor]:
    out = model(batch["input_ids"], labels=batch["input_ids"])
    return out, out.loss


def gpt2_mask_and_labels(model: nn.Module, batch: dict) -> tuple[Any, torch.Tensor]:
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    return out, out.loss


# -- Hugging Face models ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bert_with_padding_matches_torch_with_fused_attention(tmp_path: Path, attn: str) -> None:
    ort, ref = wrap_saving(tiny_bert(attn_implementation=attn), tmp_path, "bert")
    check_step_and_training(ort, ref, make_batches(bert_batch, STEPS + 1), hf_step, STEPS)
    assert_all_attention_fused(tmp_path / "bert_training.onnx")


def test_bert_without_attention_mask_matches_torch_with_fused_attention(tmp_path: Path) -> None:
    def no_mask(model: nn.Module, batch: dict) -> tuple[Any, torch.Tensor]:
        # No padding token (0) either: without aten_fallback, ORT's embedding gradient ignores padding_idx.
        out = model(input_ids=batch["input_ids"].clamp(min=1), labels=batch["labels"])
        return out, out.loss

    ort, ref = wrap_saving(tiny_bert(attn_implementation="eager"), tmp_path, "bert")
    check_step_and_training(ort, ref, make_batches(bert_batch, STEPS + 1), no_mask, STEPS)
    assert_all_attention_fused(tmp_path / "bert_training.onnx")


@pytest.mark.parametrize("step", [gpt2_labels, gpt2_mask_and_labels], ids=["no-mask", "padding-mask"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_matches_torch_with_fused_attention(tmp_path: Path, attn: str, step: Callable) -> None:
    ort, ref = wrap_saving(tiny_gpt2(attn_implementation=attn), tmp_path, "gpt2")
    check_step_and_training(ort, ref, make_batches(gpt2_batch, STEPS + 1), step, STEPS)
    assert_all_attention_fused(tmp_path / "gpt2_training.onnx")


def test_gpt2_with_aten_fallback_matches_torch_with_fused_attention(tmp_path: Path) -> None:
    ort, ref = wrap_saving(tiny_gpt2(attn_implementation="eager"), tmp_path, "gpt2", with_aten_fallback=True)
    check_step_and_training(ort, ref, make_batches(gpt2_batch, STEPS + 1), gpt2_mask_and_labels, STEPS)
    assert_all_attention_fused(tmp_path / "gpt2_training.onnx")
    assert graph_ops(tmp_path / "gpt2_training.onnx")["ATen:gelu"] == LAYERS  # aten_fallback's routing is kept


def test_inference_graph_runs_the_fused_kernel_and_matches(tmp_path: Path) -> None:
    ort, ref = wrap_saving(tiny_gpt2(attn_implementation="eager").eval(), tmp_path, "gpt2")
    batch = make_batches(gpt2_batch, 1)[0]
    with torch.no_grad():
        out, _ = gpt2_mask_and_labels(ort, batch)
        out_ref, _ = gpt2_mask_and_labels(ref, batch)
    assert_outputs_match(out, out_ref)
    ops = graph_ops(tmp_path / "gpt2_inference.onnx")
    assert ops[f"ATen:{plugin.FORWARD_OP}"] == LAYERS and "Softmax" not in ops, ops


def test_frozen_attention_inputs_get_no_gradient_and_the_rest_match(tmp_path: Path) -> None:
    model = tiny_bert(attn_implementation="eager")
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("bert.encoder.layer.0") and "embeddings" not in name)
    ort, ref = wrap_saving(model, tmp_path, "bert")
    batch = make_batches(bert_batch, 1)[0]
    (out, loss), (out_ref, loss_ref) = hf_step(ort, batch), hf_step(ref, batch)
    assert_outputs_match(out, out_ref)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert plugin.last_report().replaced == LAYERS


# -- a hand-written attention: what the pass replaces and what it leaves alone ---------------------------------------


class Attention(nn.Module):
    """One self-attention written out: projections, scaled scores, an optional additive mask, softmax, dropout."""

    def __init__(self, dim: int = 16, heads: int = 2, dropout: float = 0.0, divide: bool = False, bias: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.divide = heads, dim // heads, divide
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.bias = nn.Parameter(torch.zeros(heads, 1, 1)) if bias else None
        self.keep_probs = False

    def forward(
        self, x: torch.Tensor, allowed: torch.Tensor | None = None, float_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2)
        scores = scores / math.sqrt(self.head_dim) if self.divide else scores * self.head_dim**-0.5
        if allowed is not None:  # a boolean mask made additive inside the model, as Hugging Face does
            scores = scores + (1.0 - allowed.to(scores.dtype)) * torch.finfo(scores.dtype).min
        if float_mask is not None:
            scores = scores + float_mask
        if self.bias is not None:
            scores = scores + self.bias
        probs = self.dropout(scores.softmax(-1))
        out = self.out((probs @ v).transpose(1, 2).reshape(b, s, -1))
        return (out, probs) if self.keep_probs else out


def allowed_keys(batch: int, seq: int) -> torch.Tensor:
    """(batch, 1, seq, seq) booleans: causal, and the last two keys of row 1 padded."""
    allowed = torch.ones(seq, seq).tril().bool().expand(batch, 1, seq, seq).clone()
    allowed[1, :, :, -2:] = False
    allowed[..., 0] = True
    return allowed


@pytest.mark.parametrize("divide", [False, True], ids=["mul-scale", "div-scale"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_written_out_attention_is_fused_and_matches(tmp_path: Path, divide: bool, masked: bool) -> None:
    ort, ref = wrap_saving(Attention(divide=divide), tmp_path, "attn")
    x = torch.randn(3, 7, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    args = (allowed_keys(3, 7),) if masked else ()
    out, out_ref = ort(x, *args), ref(x_ref, *args)
    assert_outputs_match(out, out_ref)
    (out**2).sum().backward()
    (out_ref**2).sum().backward()
    assert_grads_match(ort, ref)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    assert_all_attention_fused(tmp_path / "attn_training.onnx", layers=1)


def test_pass_counts_replacements_in_a_graph(tmp_path: Path) -> None:
    ort, _ = wrap_saving(Attention(), tmp_path, "attn", enable=False)
    ort(torch.randn(2, 5, 16)).sum().backward()
    model = onnx.load(str(tmp_path / "attn_pre_grad_training.onnx"))
    before = Counter(n.op_type for n in model.graph.node)
    assert before["Softmax"] == 1, before
    report = plugin.fuse_attention(model)
    assert report.replaced == 1 and report.skipped == []
    ops = Counter(n.op_type for n in model.graph.node)
    # The two attention products go; the projections' MatMuls stay.
    assert ops["ATen"] == 1 and "Softmax" not in ops and ops["MatMul"] == before["MatMul"] - 2, ops
    # Run again: nothing is left to replace.
    assert plugin.fuse_attention(model).replaced == 0


def _skipped(model: nn.Module, tmp_path: Path, *args: torch.Tensor) -> list[str]:
    # Audit off: with dropout, the audit exports a dropout-off variant last, and its report would be the last one.
    ort, ref = wrap_saving(model, tmp_path, "attn", env={"ORTCORE_VERIFY_GRADIENTS": "0"})
    out = ort(torch.randn(2, 5, 16), *args)
    loss = (out[0] if isinstance(out, tuple) else out).sum()
    loss.backward()
    report = plugin.last_report()
    assert report.replaced == 0, report
    assert "Softmax" in graph_ops(tmp_path / "attn_training.onnx")
    return report.skipped


def test_active_dropout_is_left_to_ort_and_says_why(tmp_path: Path) -> None:
    (reason,) = _skipped(Attention(dropout=0.1), tmp_path)
    assert "dropout 0.1" in reason and "no dropout" in reason


def test_dropout_in_eval_mode_with_grad_is_fused(tmp_path: Path) -> None:
    ort, ref = wrap_saving(Attention(dropout=0.1).eval(), tmp_path, "attn")
    x = torch.randn(2, 5, 16)
    out, out_ref = ort(x), ref(x)
    assert_outputs_match(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    assert_grads_match(ort, ref)
    assert plugin.last_report().replaced == 1


def test_a_trainable_score_bias_is_left_to_ort(tmp_path: Path) -> None:
    (reason,) = _skipped(Attention(bias=True), tmp_path)
    assert "'bias'" in reason and "gradient" in reason


def test_probabilities_used_elsewhere_are_left_to_ort(tmp_path: Path) -> None:
    model = Attention()
    model.keep_probs = True
    (reason,) = _skipped(model, tmp_path)
    assert "used" in reason


def test_a_float_mask_input_is_left_to_ort(tmp_path: Path) -> None:
    # Whether a float input requires grad is not known at export: the pass does not bet on it.
    mask = torch.zeros(2, 1, 5, 5).masked_fill(~allowed_keys(2, 5), torch.finfo(torch.float32).min)
    (reason,) = _skipped(Attention(), tmp_path, None, mask)
    assert "'float_mask'" in reason


# -- the switch and its options ------------------------------------------------------------------------------------


def test_off_by_default_leaves_the_graph_alone(tmp_path: Path) -> None:
    ort, ref = wrap_saving(tiny_gpt2(attn_implementation="eager"), tmp_path, "gpt2", enable=None)
    check_step_and_training(ort, ref, make_batches(gpt2_batch, 3), gpt2_labels, 2)
    ops = graph_ops(tmp_path / "gpt2_training.onnx")
    assert ops["Softmax"] == LAYERS and not any(op.startswith("ATen") for op in ops), ops


@pytest.mark.parametrize("value, expected", [("1", True), (" 1 ", True), ("0", False)])
def test_environment_variable_switches_the_plugin(value: str, expected: bool) -> None:
    host = make_host(enable=None, env={plugin.ENV: value})
    assert host.config.plugin_options(plugin.NAME).enable is expected
    assert plugin.enabled(host.config) is expected
    assert bool(plugin.ortcore_graph_passes(host.config)) is expected
    assert plugin.ortcore_export_key(host.config) == {"efficient_attention.enable": expected}


def test_environment_wins_over_the_file() -> None:
    host = make_host(enable=True, env={plugin.ENV: "0"})
    assert not plugin.enabled(host.config)


@pytest.mark.parametrize("value", ["maybe", "true", "on", "2"])
def test_bad_value_names_the_variable_and_the_allowed_values(value: str) -> None:
    # Only 0 and 1: onnxruntime's own import parses this variable with int() ("true" fails there).
    with pytest.raises(OptionError, match=rf"{plugin.ENV}='{value}' is not a switch; allowed: 0 or 1"):
        make_host(enable=None, env={plugin.ENV: value})


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), (1, True), (0, False)])
def test_file_values(value: Any, expected: bool) -> None:
    assert make_host(enable=value).config.plugin_options(plugin.NAME).enable is expected


def test_bad_file_value_names_the_key() -> None:
    with pytest.raises(OptionError, match=r"enable.*'sometimes' is not a switch"):
        make_host(enable="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "q_lead, kv_shape",
    [((2, 3), (2, 3, 6, 4)), ((2, 3), (2, 3, 9, 4)), ((2, 3), (2, 1, 6, 4)), ((2, 3), (1, 3, 6, 4)),
     ((2, 3), (1, 1, 9, 4)), ((1, 1), (2, 3, 6, 4))],
)
def test_packed_kernels_match_torch_autograd(q_lead: tuple[int, int], kv_shape: tuple[int, ...]) -> None:
    # The helper ops against the written-out attention and its autograd in float64, with a broadcast (2-D) mask, key
    # lengths other than the query's, and q or k/v broadcast over heads or batch as MatMul allows.
    plugin.prepare_runtime()
    q = torch.randn(*q_lead, 6, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(kv_shape, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.zeros(6, kv_shape[2], dtype=torch.float64)
    mask[:, -1] = torch.finfo(torch.float64).min
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + mask, -1) @ v
    grad = torch.randn_like(expected)
    expected.backward(grad)
    qkv = torch.cat([t.detach().reshape(-1) for t in (q, k, v)])
    shapes = [list(q.shape), list(kv_shape), list(kv_shape)]
    out, lse = torch.ops.ortcore_attention.sdpa_packed(qkv, *shapes, mask, 0.3)
    torch.testing.assert_close(out, expected.detach())
    packed = torch.ops.ortcore_attention.sdpa_packed_backward(grad, qkv, *shapes, mask, 0.3, out, lse)
    torch.testing.assert_close(packed, torch.cat([t.grad.reshape(-1) for t in (q, k, v)]))


def test_works_in_a_fresh_process_without_aten_fallback() -> None:
    # The executor slot is process-wide and aten_fallback's tests may have filled it in this process already: a
    # fresh process with only this plugin shows it installs the executor itself.
    script = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import ortcore_plugins.services.aten_executor as executor
import ortcore_plugins.efficient_attention as plugin
from models import check_step_and_training, gpt2_batch, make_batches, ort_and_torch, tiny_gpt2
from ortcore.config import Config
from ortcore.host import PluginHost

assert not executor.installed()
host = PluginHost(Config.from_table({"plugins": {"efficient_attention": {"enable": True}}}, env={}),
                  autoload=False, plugins={"efficient_attention": plugin})
ort, ref = ort_and_torch(tiny_gpt2(attn_implementation="eager"), host=host)
def step(model, batch):
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    return out, out.loss
check_step_and_training(ort, ref, make_batches(gpt2_batch, 3), step, 2)
assert executor.installed() and plugin.last_report().replaced == 2, plugin.last_report()
print("ok", executor.stats().calls)
"""
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    done = subprocess.run(
        [sys.executable, "-c", script, tests_dir], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]
    assert int(done.stdout.split()[1]) > 0  # the ATen nodes really ran in the executor
