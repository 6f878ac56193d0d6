"""Parity with PyTorch for plain torch models: outputs, losses, every gradient, buffers and 20-step AdamW curves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from models import (
    HOST_KINDS,
    MLP,
    ConvNet,
    DictModel,
    EmbeddingBlock,
    assert_buffers_match,
    assert_close,
    assert_curves_match,
    assert_grads_match,
    assert_kernels,
    assert_losses_match,
    assert_outputs_match,
    assert_ran_in_ort,
    check_gradient_accumulation,
    check_step_and_training,
    classification_step,
    dict_batch,
    dict_step,
    image_batch,
    loss_of,
    make_batches,
    mlp_batch,
    mlp_step,
    ort_and_torch,
    plugin_host,
    token_batch,
    token_step,
    train_curve,
)

from ortcore.host import PluginHost

STEPS = 20


@pytest.fixture(params=HOST_KINDS, autouse=True)
def host(request: pytest.FixtureRequest) -> Iterator[PluginHost]:
    """Every test runs on a bare host (ORT's own kernels) and on the default host (the installed plugins)."""
    with plugin_host(request.param) as pinned:
        yield pinned


def test_mlp_matches_torch():
    ort, ref = ort_and_torch(MLP())
    check_step_and_training(ort, ref, make_batches(mlp_batch, STEPS + 1), mlp_step, STEPS)
    assert_ran_in_ort(ort, exports=1)


def test_input_gradient_matches_torch():
    ort, ref = ort_and_torch(MLP())
    (x, y), (x2, y2) = make_batches(mlp_batch, 2)
    x_ort, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, loss = mlp_step(ort, (x_ort, y))
    out_ref, loss_ref = mlp_step(ref, (x_ref, y))
    assert_outputs_match(out, out_ref)
    loss.backward()
    loss_ref.backward()
    assert_close(x_ort.grad, x_ref.grad, "grad of the input", "grads")
    assert_grads_match(ort, ref)
    # The same call without an input gradient needs another gradient graph, not another export.
    for model in (ort, ref):
        model.zero_grad(set_to_none=True)
        loss_of(mlp_step)(model, (x2, y2)).backward()
    assert_grads_match(ort, ref)
    assert_ran_in_ort(ort, exports=1)


def test_frozen_parameters_get_no_gradient_and_stay_put():
    model = MLP()
    model.fc1.weight.requires_grad_(False)
    ort, ref = ort_and_torch(model)
    frozen = ort.module.fc1.weight.detach().clone()
    check_step_and_training(ort, ref, make_batches(mlp_batch, 6), mlp_step, steps=5)
    assert ort.module.fc1.weight.grad is None
    assert torch.equal(ort.module.fc1.weight, frozen)
    assert_ran_in_ort(ort, exports=1)


def test_cnn_with_batch_norm_matches_torch_including_running_statistics():
    ort, ref = ort_and_torch(ConvNet())
    batches = make_batches(image_batch, STEPS + 1)

    # One step in full: outputs, loss, gradients, and the running statistics the forward updated.
    out, loss = classification_step(ort, batches[0])
    out_ref, loss_ref = classification_step(ref, batches[0])
    assert_outputs_match(out, out_ref)
    assert_losses_match(loss, loss_ref)
    assert_buffers_match(ort, ref)
    assert int(ort.module.bn.num_batches_tracked) == 1
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    # Training: the buffers are compared after every optimizer step.
    snapshots: dict[str, list[dict[str, torch.Tensor]]] = {"ort": [], "torch": []}

    def snapshot(side):
        return lambda _step, model: snapshots[side].append({k: b.clone() for k, b in model.named_buffers()})

    curve = train_curve(ort, batches[1:], loss_of(classification_step), STEPS, on_step=snapshot("ort"))
    curve_ref = train_curve(ref, batches[1:], loss_of(classification_step), STEPS, on_step=snapshot("torch"))
    assert_curves_match(curve, curve_ref)
    for step, (a, e) in enumerate(zip(snapshots["ort"], snapshots["torch"], strict=True)):
        assert list(a) == list(e)
        for name in e:
            assert_close(a[name], e[name], f"buffer {name} after step {step}", "buffers")
    assert int(ort.module.bn1d.num_batches_tracked) == STEPS + 1

    # Eval mode after training: outputs from the running statistics (autograd in eval mode: see the next test).
    ort.eval()
    ref.eval()
    x, _ = make_batches(image_batch, 1, seed=99)[0]
    with torch.no_grad():
        assert_outputs_match(ort(x), ref(x))
    assert_buffers_match(ort, ref)  # eval mode leaves the statistics alone
    assert_ran_in_ort(ort, exports=2)  # one training graph, one eval graph


def test_batch_norm_in_eval_mode_with_autograd_uses_running_statistics():
    """Fine-tuning with frozen statistics (model.eval(), grads on) must use the running statistics, as torch does."""
    ort, ref = ort_and_torch(ConvNet())
    batches = make_batches(image_batch, 6)
    train_curve(ort, batches[:3], loss_of(classification_step))
    train_curve(ref, batches[:3], loss_of(classification_step))
    ort.eval()
    ref.eval()
    out, loss = classification_step(ort, batches[3])
    out_ref, loss_ref = classification_step(ref, batches[3])
    assert_outputs_match(out, out_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    curve = train_curve(ort, batches[4:], loss_of(classification_step))
    curve_ref = train_curve(ref, batches[4:], loss_of(classification_step))
    assert_curves_match(curve, curve_ref)
    assert_buffers_match(ort, ref)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_embedding_layernorm_gelu_matches_torch(approximate, host):
    ort, ref = ort_and_torch(EmbeddingBlock(approximate=approximate))
    check_step_and_training(ort, ref, make_batches(token_batch, STEPS + 1), token_step, STEPS)
    assert_ran_in_ort(ort, exports=1)
    # The exporter writes GELU as elementwise ops (Erf or Tanh), which ORT differentiates itself.
    assert_kernels(ort, host, {"Gather", "GatherGrad", "LayerNormalization", "LayerNormalizationGrad"})


@pytest.mark.parametrize("with_mask", [False, True], ids=["optional_argument_none", "optional_argument_given"])
def test_dict_and_nested_list_inputs_with_tuple_output_match_torch(with_mask):
    ort, ref = ort_and_torch(DictModel())
    batches = make_batches(lambda gen: dict_batch(gen, with_mask=with_mask), STEPS + 1)
    check_step_and_training(ort, ref, batches, dict_step, STEPS)
    if not with_mask:  # the gate only runs with a mask: no gradient for it on either side
        assert ort.module.gate.weight.grad is None and ref.gate.weight.grad is None
    assert_ran_in_ort(ort, exports=1)


def test_changed_float_keyword_is_not_served_by_a_stale_graph():
    ort, ref = ort_and_torch(DictModel())
    inputs = make_batches(dict_batch, 1)[0]
    for scale in (0.5, 2.0, 0.5):
        out, loss = dict_step(ort, inputs, scale=scale)
        out_ref, loss_ref = dict_step(ref, inputs, scale=scale)
        assert_outputs_match(out, out_ref)
        assert_losses_match(loss, loss_ref)
        ort.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(ort, ref)
    assert_ran_in_ort(ort, exports=2)  # 0.5 is exported once and its graph reused


@pytest.mark.parametrize(
    "model_fn, make_batch, step",
    [
        (MLP, mlp_batch, mlp_step),
        (lambda: EmbeddingBlock(approximate="tanh"), token_batch, token_step),
    ],
    ids=["mlp", "embedding_block"],
)
def test_gradient_accumulation_over_two_backwards_matches_torch(model_fn, make_batch, step):
    ort, ref = ort_and_torch(model_fn())
    check_gradient_accumulation(ort, ref, make_batches(make_batch, 2 * 10), step)


def test_two_forwards_then_one_backward_matches_torch():
    """Both forwards' saved activations are alive at once (a sum of two losses, one backward)."""
    ort, ref = ort_and_torch(EmbeddingBlock())
    first, second = make_batches(token_batch, 2)
    losses = {}
    for name, model in (("ort", ort), ("torch", ref)):
        losses[name] = loss_of(token_step)(model, first) + 2.0 * loss_of(token_step)(model, second)
        losses[name].backward()
    assert_losses_match(losses["ort"], losses["torch"])
    assert_grads_match(ort, ref)
    assert_ran_in_ort(ort, exports=1)


def test_batch_size_and_sequence_length_changes_re_export_once_per_dimension():
    """The first call's sizes, then a graph dynamic in the batch (the second call), then one dynamic in the length
    too (the third): every later shape reuses it."""
    ort, ref = ort_and_torch(EmbeddingBlock())
    gen = torch.Generator().manual_seed(7)
    shapes = [(4, 10), (2, 10), (4, 3), (7, 16), (1, 1), (3, 25)] * 3
    batches = [token_batch(gen, batch=b, seq=s) for b, s in shapes]
    curve = train_curve(ort, batches, loss_of(token_step))
    curve_ref = train_curve(ref, batches, loss_of(token_step))
    assert_curves_match(curve, curve_ref)
    # Gradients at a new shape after training, too.
    extra = token_batch(gen, batch=5, seq=6)
    for model in (ort, ref):
        model.zero_grad(set_to_none=True)
        loss_of(token_step)(model, extra).backward()
    assert_grads_match(ort, ref)
    assert_ran_in_ort(ort, exports=3)
    assert ort.state_machine.counters.builds == 3


def test_mlp_batch_size_change_mid_training_re_exports_once():
    ort, ref = ort_and_torch(MLP())
    gen = torch.Generator().manual_seed(3)
    batches = [mlp_batch(gen, batch=b) for b in [16] * 5 + [3] * 5 + [1, 32, 16, 2, 9]]
    curve = train_curve(ort, batches, loss_of(mlp_step))
    curve_ref = train_curve(ref, batches, loss_of(mlp_step))
    assert_curves_match(curve, curve_ref)
    assert_ran_in_ort(ort, exports=2)  # the first batch's size, then a graph dynamic in it


def test_outputs_match_under_no_grad_and_grads_still_match_afterwards():
    ort, ref = ort_and_torch(MLP())
    x, y = make_batches(mlp_batch, 1)[0]
    with torch.no_grad():
        assert_outputs_match(ort(x), ref(x))
    out, loss = mlp_step(ort, (x, y))
    out_ref, loss_ref = mlp_step(ref, (x, y))
    assert_outputs_match(out, out_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert_ran_in_ort(ort, exports=1)  # no_grad needs another session, not another export
