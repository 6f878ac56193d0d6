"""Hugging Face ``Trainer`` with ``bf16=True`` on CPU over an ORTModule trains in ONNX Runtime like the plain model.

``TrainingArguments(bf16=True, use_cpu=True)`` makes accelerate wrap the model's ``forward`` in
``torch.autocast("cpu", dtype=torch.bfloat16)`` (and cast the outputs back to float32). ORTModule exports the graph
under that autocast state (it is part of the graph key, ``GraphKey.autocast``), so the graph computes autocast's
bf16 numbers, and ORT runs it (the mixed_precision plugin places the bf16 nodes ORT's CPU provider cannot run).

Each test trains a small BERT or GPT-2 built from a config (``plugins/services/example_models.py``, preset "quick":
1 layer, hidden 64, vocabulary 1000, nothing downloaded) for 5 steps, logging every step, twice from the same weights
on the same in-memory dataset: the plain model and ``ORTModule(model)``, both under ``Trainer`` (or ortcore's
``ORTTrainer``) with ``bf16=True``. It compares the logged losses, and checks that the ORTModule ran in ORT (no
fallback, one export) from a graph exported under bf16 autocast (the key's autocast field; bf16 logits in the graph).

Tolerance: losses ``2**-8`` relative (3.9e-3, bfloat16's machine epsilon: bf16 keeps 8 significant bits, so every
matrix product of either run is rounded at that scale, in another order on each side). Measured on the runs below
(5 steps, lr 5e-3): ORT against eager bf16 at most 6.0e-5 (GPT-2) and 2.9e-4 (BERT), while eager bf16 is 2.0e-4
(GPT-2) and 2.2e-3 (BERT) from the same model trained in float32: ortcore's deviation is below bf16's own.
"""

from __future__ import annotations

import copy
from typing import Any

import onnx
import pytest
import torch
from models import assert_ran_in_ort, wrap

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ortcore_plugins.services.example_models import build_model, preset  # noqa: E402

STEPS = 5
LR = 5e-3  # large enough that 5 steps move the loss (and bf16 rounding shows in it)
SEQ = 16
BF16_LOSS_RTOL = 2.0**-8
CONFIG = preset("quick")


def dataset(kind: str, n: int = 20, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of ``SEQ`` tokens, two in three right-padded; "lm": labels are the ids (padding -100), else a
    binary class per row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 3:
            mask[SEQ - i % 3 :] = 0
        ids = torch.randint(1, CONFIG.vocab, (SEQ,), generator=gen) * mask
        labels = ids.masked_fill(mask == 0, -100) if kind == "lm" else torch.randint(0, 2, (), generator=gen)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def trainer(cls: type, model: torch.nn.Module, kind: str, output_dir: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        seed=42,
        data_seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return cls(model=model, args=args, train_dataset=dataset(kind), eval_dataset=dataset(kind, n=8, seed=9))


def logged_losses(trained: Any) -> list[float]:
    return [entry["loss"] for entry in trained.state.log_history if "loss" in entry]


def assert_exported_under_bf16_autocast(model: Any) -> None:
    """The graph the last call ran was exported under ``torch.autocast("cpu", dtype=torch.bfloat16)``: the key says
    so, and the graph computes in bf16 (bf16 logits; the loss is float32, as Hugging Face upcasts logits for it)."""
    assert model.state_machine.last_key.autocast == (("cpu", "bfloat16"),)
    graph, _ = model.state_machine.current
    types = {o.name: o.type.tensor_type.elem_type for o in graph.model.graph.output}
    assert types["output.logits"] == onnx.TensorProto.BFLOAT16, types
    assert types["output.loss"] == onnx.TensorProto.FLOAT, types


def ort_trainer_class() -> type:
    from ortcore_plugins.hf_trainer import ORTTrainer

    return ORTTrainer


@pytest.mark.parametrize(
    "name, trainer_kind", [("gpt2", "Trainer"), ("bert", "Trainer"), ("gpt2", "ORTTrainer")], ids=lambda v: v
)
def test_bf16_trainer_over_ortmodule_logs_the_plain_models_losses(tmp_path, name, trainer_kind):
    cls = transformers.Trainer if trainer_kind == "Trainer" else ort_trainer_class()
    kind = "lm" if name == "gpt2" else "classification"
    torch.manual_seed(0)
    model = build_model(name, CONFIG)
    plain = copy.deepcopy(model)
    ort = wrap(model)  # fallback disabled: an ORT failure raises instead of training in PyTorch

    reference = trainer(transformers.Trainer, plain, kind, tmp_path / "plain")
    ours = trainer(cls, ort, kind, tmp_path / "ort")
    result_ref, result = reference.train(), ours.train()

    losses, losses_ref = logged_losses(ours), logged_losses(reference)
    assert len(losses_ref) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), rtol=BF16_LOSS_RTOL, atol=0.0)
    assert result.training_loss == pytest.approx(result_ref.training_loss, rel=BF16_LOSS_RTOL)
    assert result.global_step == STEPS

    assert ours.model is ort
    assert_ran_in_ort(ort, exports=1)
    counters = ort.state_machine.counters
    assert counters.repairs == 0 and counters.builds == 1, counters
    assert [t.action for t in ort.state_machine.history if t.action in ("export", "build")] == ["export", "build"]
    assert_exported_under_bf16_autocast(ort)
    # The weights stay float32 (autocast computes in bf16, the optimizer updates fp32 weights), as for the plain model.
    assert {p.dtype for p in ort.parameters()} == {torch.float32}


def test_bf16_trainer_evaluate_runs_in_ort_with_the_plain_models_eval_loss(tmp_path):
    """``Trainer.evaluate`` runs the model under the same autocast without gradients: an inference graph of its own,
    exported under bf16 autocast too."""
    torch.manual_seed(0)
    model = build_model("gpt2", CONFIG)
    plain = copy.deepcopy(model)
    ort = wrap(model)
    reference = trainer(transformers.Trainer, plain, "lm", tmp_path / "plain")
    ours = trainer(transformers.Trainer, ort, "lm", tmp_path / "ort")
    reference.train()
    ours.train()
    metrics, metrics_ref = ours.evaluate(), reference.evaluate()
    assert metrics["eval_loss"] == pytest.approx(metrics_ref["eval_loss"], rel=BF16_LOSS_RTOL)
    assert_ran_in_ort(ort, exports=2)  # the training graph, then the eval-mode inference graph
    assert_exported_under_bf16_autocast(ort)
    assert not ort.state_machine.last_key.training
