"""Parity with PyTorch for Hugging Face models (tiny configs, random init, dropout off), including a Trainer run."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from models import (
    HF_VOCAB,
    HOST_KINDS,
    adamw,
    assert_close,
    assert_curves_match,
    assert_grads_match,
    assert_kernels,
    assert_losses_match,
    assert_outputs_match,
    assert_ran_in_ort,
    bert_batch,
    causal_lm_loss,
    check_gradient_accumulation,
    check_step_and_training,
    gpt2_batch,
    hf_step,
    loss_of,
    make_batches,
    ort_and_torch,
    plugin_host,
    tiny_bert,
    tiny_gpt2,
    train_curve,
    wrap,
)

from ortcore.host import PluginHost

transformers = pytest.importorskip("transformers")

STEPS = 20


@pytest.fixture(params=HOST_KINDS, autouse=True)
def host(request: pytest.FixtureRequest) -> Iterator[PluginHost]:
    """Every test runs on a bare host (ORT's own kernels) and on the default host (the installed plugins)."""
    with plugin_host(request.param) as pinned:
        yield pinned


# ONNX Runtime's own kernels the bare host checks against PyTorch (forward and gradient).
BERT_KERNELS = {"Gather", "GatherGrad", "LayerNormalization", "LayerNormalizationGrad", "Gelu", "GeluGrad"}
GPT2_KERNELS = {"Gather", "GatherGrad", "LayerNormalization", "LayerNormalizationGrad", "FastGelu", "FastGeluGrad"}
CROSS_ENTROPY_KERNELS = {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"}


def test_bert_sequence_classification_with_padding_and_labels_matches_torch(host):
    ort, ref = ort_and_torch(tiny_bert())
    batches = make_batches(bert_batch, STEPS + 1)
    assert (batches[0]["attention_mask"] == 0).any(), "the first batch should contain padding"
    check_step_and_training(ort, ref, batches, hf_step, STEPS)
    assert_ran_in_ort(ort, exports=1)
    assert_kernels(ort, host, BERT_KERNELS | CROSS_ENTROPY_KERNELS)

    # After training, eval mode (dropout is off anyway, but eval is its own graph) under no_grad.
    ort.eval()
    ref.eval()
    batch = make_batches(bert_batch, 1, seed=77)[0]
    with torch.no_grad():
        out, out_ref = ort(**batch), ref(**batch)
    assert_outputs_match(out, out_ref)
    assert_ran_in_ort(ort, exports=2)


def test_bert_with_token_type_ids_and_no_mask_matches_torch():
    """Logits only (no labels, no attention_mask), token_type_ids given, the loss computed by the user."""

    def step(model, batch):
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"])
        return out, torch.nn.functional.cross_entropy(out.logits, batch["labels"])

    def make_batch(gen):
        batch = bert_batch(gen)
        batch["input_ids"] = torch.randint(1, HF_VOCAB, batch["input_ids"].shape, generator=gen)
        batch["token_type_ids"] = (torch.arange(batch["input_ids"].shape[1]) >= 5).long().expand_as(batch["input_ids"])
        return batch

    ort, ref = ort_and_torch(tiny_bert())
    check_step_and_training(ort, ref, make_batches(make_batch, STEPS + 1), step, STEPS)
    assert_ran_in_ort(ort, exports=1)


# -- GPT-2, called the ways users call it ------------------------------------------------------------------------


def _gpt2_ids_only(model, batch):
    out = model(batch["input_ids"])
    return out, causal_lm_loss(out.logits, batch["input_ids"])


def _gpt2_with_attention_mask(model, batch):
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    return out, causal_lm_loss(out.logits, batch["input_ids"], batch["attention_mask"])


def _gpt2_with_labels(model, batch):
    out = model(batch["input_ids"], labels=batch["input_ids"])
    return out, out.loss


GPT2_CALLS = {
    "without_attention_mask": _gpt2_ids_only,
    "with_attention_mask": _gpt2_with_attention_mask,
    "with_labels": _gpt2_with_labels,
}


@pytest.mark.parametrize("call", list(GPT2_CALLS))
def test_gpt2_matches_torch(call, host):
    """Outputs (logits, loss, and the DynamicCache's keys and values), gradients, and a 20-step AdamW curve.

    lm_head.weight is tied to transformer.wte.weight: the shared parameter must get the sum of both uses' gradients
    (assert_grads_match compares it) and stay tied through training.
    """
    step = GPT2_CALLS[call]
    ort, ref = ort_and_torch(tiny_gpt2())
    assert ort.module.lm_head.weight is ort.module.transformer.wte.weight
    batches = make_batches(gpt2_batch, STEPS + 1)

    out, _ = step(ort, batches[0])
    cache = out.past_key_values
    assert isinstance(cache, transformers.DynamicCache), f"use_cache is on in training: got {type(cache)}"
    assert len(cache.layers) == ort.config.n_layer and cache.get_seq_length() == batches[0]["input_ids"].shape[1]
    del out, cache

    check_step_and_training(ort, ref, batches, step, STEPS)
    assert ort.module.lm_head.weight is ort.module.transformer.wte.weight
    assert_ran_in_ort(ort, exports=1)
    assert_kernels(ort, host, GPT2_KERNELS | (CROSS_ENTROPY_KERNELS if call == "with_labels" else set()))


def test_gpt2_without_cache_matches_torch():
    """use_cache=False sends Hugging Face's mask code through a cumsum of booleans (no ONNX CumSum for bool)."""

    def step(model, batch):
        out = model(batch["input_ids"], labels=batch["input_ids"], use_cache=False)
        assert out.past_key_values is None
        return out, out.loss

    ort, ref = ort_and_torch(tiny_gpt2())
    check_step_and_training(ort, ref, make_batches(gpt2_batch, 6), step, 5)
    assert_ran_in_ort(ort, exports=1)


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_models_with_dropout_train_in_ort(model):
    """Dropout on: ORT draws its own masks (no parity with torch's RNG), but the graph builds and training works."""
    if model == "bert":
        net = tiny_bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
        batch = make_batches(bert_batch, 1)[0]
    else:
        net = tiny_gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        batch = make_batches(gpt2_batch, 1)[0]
        batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    ort = wrap(net)
    optimizer = adamw(ort)
    losses = []
    for _ in range(5):
        loss = ort(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert_ran_in_ort(ort, exports=1)


@pytest.mark.parametrize("grad_enabled", [False, True], ids=["no_grad", "grad_enabled"])
def test_gpt2_eval_mode_after_training_matches_torch(grad_enabled):
    ort, ref = ort_and_torch(tiny_gpt2())
    batches = make_batches(gpt2_batch, 6)
    train_curve(ort, batches[:5], loss_of(_gpt2_with_labels))
    train_curve(ref, batches[:5], loss_of(_gpt2_with_labels))
    ort.load_state_dict(ref.state_dict())  # drop the rounding-noise drift of zero-gradient parameters (key bias)
    ort.eval()
    ref.eval()
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad_enabled):
        out, loss = _gpt2_with_attention_mask(ort, batches[5])
        out_ref, loss_ref = _gpt2_with_attention_mask(ref, batches[5])
    assert_outputs_match(out, out_ref)
    assert_losses_match(loss, loss_ref)
    if grad_enabled:
        loss.backward()
        loss_ref.backward()
        assert_grads_match(ort, ref)
    assert_ran_in_ort(ort, exports=2)


def test_gpt2_tied_embedding_gradient_is_the_sum_of_both_uses():
    """The gradient of wte (tied to lm_head) equals the gradient of an untied copy's wte plus its lm_head."""
    ort, _ = ort_and_torch(tiny_gpt2())
    untied = tiny_gpt2()
    untied.load_state_dict(ort.state_dict())
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
    batch = make_batches(gpt2_batch, 1)[0]
    _gpt2_with_labels(ort, batch)[1].backward()
    _gpt2_with_labels(untied, batch)[1].backward()
    expected = untied.transformer.wte.weight.grad + untied.lm_head.weight.grad
    assert_close(ort.module.transformer.wte.weight.grad, expected, "grad of tied wte/lm_head", "grads")
    # Both uses contribute: neither part alone is the answer.
    assert untied.lm_head.weight.grad.abs().max() > 1e-3 and untied.transformer.wte.weight.grad.abs().max() > 1e-3
    assert_ran_in_ort(ort, exports=1)


def test_gpt2_batch_size_and_sequence_length_changes_re_export_once_per_dimension():
    """The first call's sizes, then a graph dynamic in the batch, then one dynamic in the length too."""
    ort, ref = ort_and_torch(tiny_gpt2())
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, 12), (1, 12), (3, 5), (5, 20), (2, 2), (4, 9)] * 2
    batches = [gpt2_batch(gen, batch=b, seq=s) for b, s in shapes]
    curve = train_curve(ort, batches, loss_of(_gpt2_with_attention_mask))
    curve_ref = train_curve(ref, batches, loss_of(_gpt2_with_attention_mask))
    assert_curves_match(curve, curve_ref)
    # Outputs and gradients at yet another shape, from identical weights: parameters whose gradient is zero in
    # exact arithmetic (the key bias) have drifted apart on rounding noise under Adam, so re-synchronise first.
    ort.load_state_dict(ref.state_dict())
    extra = gpt2_batch(gen, batch=2, seq=7)
    out, loss = _gpt2_with_attention_mask(ort, extra)
    out_ref, loss_ref = _gpt2_with_attention_mask(ref, extra)
    assert_outputs_match(out, out_ref)
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert_ran_in_ort(ort, exports=3)
    assert ort.state_machine.counters.builds == 3


def test_gpt2_gradient_accumulation_over_two_backwards_matches_torch():
    ort, ref = ort_and_torch(tiny_gpt2())
    check_gradient_accumulation(ort, ref, make_batches(gpt2_batch, 2 * 8), _gpt2_with_labels)


def test_wrapped_model_keeps_the_forward_signature():
    ort, _ = ort_and_torch(tiny_gpt2())
    assert inspect.signature(ort.forward) == inspect.signature(ort.module.forward)


# -- Hugging Face Trainer ----------------------------------------------------------------------------------------


def _dataset(kind: str, n: int = 16, seq: int = 10, seed: int = 3) -> list[dict[str, Any]]:
    """A tiny in-memory dataset of dicts; "note" is not a forward argument, so Trainer must drop it.

    ``kind`` "lm": labels are the input ids (padding -100); "classification": one class per row.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(1, HF_VOCAB, (seq,), generator=gen)
        mask = torch.ones(seq, dtype=torch.long)
        mask[seq - i % 3 :] = 0 if i % 3 else 1  # two rows in three end with padding
        ids = ids * mask
        if kind == "lm":
            labels = ids.masked_fill(mask == 0, -100)
        else:
            labels = torch.randint(0, 3, (), generator=gen)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "note": f"row {i}"})
    return rows


TRAINER_MODELS = {"gpt2": (tiny_gpt2, "lm"), "bert": (tiny_bert, "classification")}


def _trainer(model: torch.nn.Module, kind: str, output_dir, **overrides: Any) -> transformers.Trainer:
    settings: dict[str, Any] = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        max_steps=4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        seed=42,
        data_seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**settings),
        train_dataset=_dataset(kind),
        eval_dataset=_dataset(kind, n=8, seed=9),
    )


@pytest.mark.parametrize(
    "name, accumulation",
    [("gpt2", 1), ("gpt2", 2), ("bert", 1)],
    ids=["gpt2", "gpt2_gradient_accumulation", "bert"],
)
def test_trainer_with_wrapped_model_logs_the_losses_of_the_plain_model(tmp_path, name, accumulation):
    build, kind = TRAINER_MODELS[name]
    ort, ref = ort_and_torch(build())
    trainer = _trainer(ort, kind, tmp_path / "ort", gradient_accumulation_steps=accumulation)
    trainer_ref = _trainer(ref, kind, tmp_path / "torch", gradient_accumulation_steps=accumulation)
    result, result_ref = trainer.train(), trainer_ref.train()

    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    logged_ref = [e["loss"] for e in trainer_ref.state.log_history if "loss" in e]
    assert len(logged_ref) == 4
    assert_curves_match(logged, logged_ref)
    assert_losses_match(result.training_loss, result_ref.training_loss, "Trainer's training_loss")
    assert result.global_step == result_ref.global_step == 4
    # The wrapped model really trained in ORT, from one export (Trainer used the forward signature to drop "note").
    assert trainer.model is ort
    assert_ran_in_ort(ort, exports=1)


def test_trainer_evaluate_with_label_names_matches_the_plain_model(tmp_path):
    ort, ref = ort_and_torch(tiny_gpt2())
    trainer = _trainer(ort, "lm", tmp_path / "ort", max_steps=2, label_names=["labels"])
    trainer_ref = _trainer(ref, "lm", tmp_path / "torch", max_steps=2, label_names=["labels"])
    trainer.train()
    trainer_ref.train()
    metrics, metrics_ref = trainer.evaluate(), trainer_ref.evaluate()
    assert_losses_match(metrics["eval_loss"], metrics_ref["eval_loss"], "eval_loss")
    assert_ran_in_ort(ort)


def test_trainer_evaluate_reports_the_eval_loss_of_the_plain_model(tmp_path):
    ort, ref = ort_and_torch(tiny_gpt2())
    trainer = _trainer(ort, "lm", tmp_path / "ort", max_steps=2)
    trainer_ref = _trainer(ref, "lm", tmp_path / "torch", max_steps=2)
    assert trainer.label_names == trainer_ref.label_names == ["labels"]
    trainer.train()
    trainer_ref.train()
    metrics, metrics_ref = trainer.evaluate(), trainer_ref.evaluate()
    assert "eval_loss" in metrics, f"no eval_loss in {metrics}"
    assert_losses_match(metrics["eval_loss"], metrics_ref["eval_loss"], "eval_loss")


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_ort_trainer_saves_a_model_from_pretrained_loads(tmp_path, name):
    """``Trainer`` writes only the state dict of a model that is not a ``PreTrainedModel`` (no config.json; tied
    weights refused); ``ORTTrainer`` saves the wrapped model with ``save_pretrained``, checkpoints included."""
    from ortcore_plugins.hf_trainer import ORTTrainer

    build, kind = TRAINER_MODELS[name]
    ort = ort_and_torch(build())[0]
    base = _trainer(ort, kind, tmp_path / "run", save_strategy="steps", save_steps=2)
    trainer = ORTTrainer(model=ort, args=base.args, train_dataset=base.train_dataset)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert trainer.model is ort  # the wrapper is back after saving
    for folder in (tmp_path / "final", tmp_path / "run" / "checkpoint-4"):
        assert (folder / "config.json").exists(), sorted(p.name for p in folder.iterdir())
        loaded = type(ort.module).from_pretrained(folder)
        for (key, value), (key_ref, value_ref) in zip(loaded.state_dict().items(), ort.module.state_dict().items()):
            assert key == key_ref
            torch.testing.assert_close(value, value_ref, rtol=0, atol=0, msg=f"{folder.name}: {key}")
    assert_ran_in_ort(ort)


# -- long runs (slow) --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_long_training_curve_matches_torch(name):
    """200 AdamW steps of a somewhat larger model (4 layers, hidden 128, sequence 32): no drift at any step."""
    size = dict(n_layer=4, n_embd=128, n_head=4) if name == "gpt2" else dict(num_hidden_layers=4, hidden_size=128)
    model = tiny_gpt2(**size) if name == "gpt2" else tiny_bert(intermediate_size=256, **size)
    make = (lambda g: gpt2_batch(g, batch=4, seq=32)) if name == "gpt2" else (lambda g: bert_batch(g, batch=8, seq=32))
    step = _gpt2_with_attention_mask if name == "gpt2" else hf_step
    ort, ref = ort_and_torch(model)
    check_step_and_training(ort, ref, make_batches(make, 201), step, steps=200)
    assert_ran_in_ort(ort, exports=1)
