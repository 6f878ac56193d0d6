"""The third zoo (``catalog_third``): 40+ models new to the zoo, each described, recorded and rendered; its
plain-torch models are well-formed (fast). The models themselves run in the slow suite
(``python -m pytest tests/zoo -m slow -k third``, via ``test_zoo``)."""

from __future__ import annotations

import copy

import pytest
import torch

from .catalog import MODELS as MAIN
from .catalog_third import MODELS as THIRD_MODELS
from .catalog_third import EMAQuantizer, RunningStats
from .catalog_wide import MODELS as WIDE_MODELS
from .catalogs import models
from .harness import EXPORTERS
from .report import DEFAULT_OUT, REGENERATE, THIRD, load_records, render_third

TORCH = [name for name, spec in THIRD_MODELS.items() if spec.family == "torch"]


def _normalized(name: str) -> str:
    return name.replace("_", "").replace("-", "")


def test_third_zoo_is_40_new_models_each_described() -> None:
    third = models(THIRD)
    assert list(third) == list(THIRD_MODELS)
    assert len(third) >= 40
    # Not the same name, nor the same name spelt with other separators (gpt_neox / gptneox).
    known = {_normalized(n) for n in [*MAIN, *WIDE_MODELS]}
    repeated = sorted(n for n in third if _normalized(n) in known)
    assert not repeated, f"the third zoo repeats models of the other zoos: {repeated}"
    assert all(m.description and m.family in ("transformers", "torchvision", "torch") for m in third.values())


def test_third_zoo_is_recorded_and_on_the_page() -> None:
    records = load_records(catalog=THIRD)
    assert EXPORTERS[0] in records, f"no record of the third zoo; run {REGENERATE} --catalog third"
    for route, record in records.items():
        assert list(record["models"]) == list(THIRD_MODELS), f"the {route} record is not of the whole catalog"
    page = DEFAULT_OUT.read_text()
    assert render_third(records) in page, f"docs/models.md lacks the third zoo's section; run {REGENERATE} --render"


def _loss(spec, model, batch) -> torch.Tensor:
    return spec.loss(model(**spec.inputs(batch)), batch)


@pytest.mark.parametrize("name", TORCH)
def test_plain_torch_model_is_a_deterministic_function_of_its_batch(name: str) -> None:
    """Two builds under the same seed on the same batch give the same finite loss and every parameter a finite
    gradient: randomness is drawn by the batch, not in forward, so eager and ortcore can be compared at all."""
    spec = THIRD_MODELS[name]
    losses, grads = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = spec.build().train()
        batch = spec.batch(torch.Generator().manual_seed(1234))
        loss = _loss(spec, model, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])
    missing = [n for n, g in grads[0].items() if g is None]
    assert not missing, f"{name}: parameters without a gradient {missing}"
    for n, g in grads[0].items():
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient of {n}"
        torch.testing.assert_close(g, grads[1][n], rtol=0, atol=0)


def test_the_buffer_writing_models_do_write_their_buffers() -> None:
    """vq_ema and running_stats exist to exercise buffer writes in the top module's forward: they must do so."""
    batch = THIRD_MODELS["vq_ema"].batch(torch.Generator().manual_seed(0))
    for cls in (EMAQuantizer, RunningStats):
        torch.manual_seed(0)
        model = cls().train()
        before = copy.deepcopy(dict(model.named_buffers()))
        model(**batch)
        changed = [n for n, b in model.named_buffers() if not torch.equal(b, before[n])]
        assert changed == list(before), f"{cls.__name__}: buffers left unwritten {set(before) - set(changed)}"
        model.eval()
        frozen = copy.deepcopy(dict(model.named_buffers()))
        model(**batch)
        assert all(torch.equal(b, frozen[n]) for n, b in model.named_buffers()), "buffers written in eval mode"
