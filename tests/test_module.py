"""ORTModule as a drop-in ``nn.Module``: wrapping, checkpoints, copies, optimizers, training semantics, IO schema.

Every numeric check compares with the same model run in PyTorch, starting from identical weights.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import inspect
import io
import pickle
from typing import ClassVar

import pytest
import torch
from models import assert_grads_match, ort_and_torch, wrap
from torch import nn

import ortcore
from ortcore import DebugOptions, LogLevel, ORTModule

RTOL, ATOL = 1e-4, 1e-5


def assert_close(actual, expected, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


def assert_params_match(ort_model: nn.Module, torch_model: nn.Module) -> None:
    for (name, p), (_, q) in zip(ort_model.named_parameters(), torch_model.named_parameters(), strict=True):
        assert_close(p, q, msg=f"parameter {name}")


class MLP(nn.Module):
    """Two linear layers and a buffer; ``some_attr`` and ``describe`` are for attribute fall-through."""

    def __init__(self, d_in: int = 4, d_hidden: int = 8, d_out: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, d_out))
        self.some_attr = "mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.offset

    def describe(self) -> str:
        return f"{self.some_attr} with {self.fc1.in_features} inputs"


class EmbeddingModel(nn.Module):
    """Integer token ids in, floats out: no floating-point input to carry the dtype."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


class Regularized(nn.Module):
    """Dropout and batch norm: train and eval differ."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.fc(x)))))


# -- drop-in --------------------------------------------------------------------------------------------------------


def test_public_names_import_and_ortmodule_is_a_module():
    assert ortcore.ORTModule is ORTModule
    assert isinstance(DebugOptions(), DebugOptions)
    assert LogLevel.WARNING.name == "WARNING"
    model = wrap(MLP())
    assert isinstance(model, nn.Module)


def test_parameters_buffers_and_state_dict_keys_equal_wrapped_model():
    inner = MLP()
    model = wrap(inner)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in inner.named_parameters()]
    assert all(p is q for p, q in zip(model.parameters(), inner.parameters(), strict=True))
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in inner.named_buffers()]
    assert list(model.state_dict()) == list(inner.state_dict())
    model(torch.randn(2, 4))  # exporting adds nothing to the state
    assert list(model.state_dict()) == list(inner.state_dict())


def test_checkpoint_from_ortmodule_loads_into_torch_model():
    model = wrap(MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    plain = MLP()
    plain.load_state_dict(torch.load(buffer))
    x = torch.randn(3, 4)
    assert_close(model(x), plain(x))


def test_torch_checkpoint_loads_into_ortmodule_without_reexport():
    trained = MLP()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    model = wrap(MLP())
    x = torch.randn(3, 4)
    model(x)
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    model.load_state_dict(torch.load(buffer))
    assert_close(model(x), trained(x))
    assert model.state_machine.counters.exports == 1


def test_train_and_eval_propagate_to_wrapped_model():
    inner = Regularized()
    model = wrap(inner)
    model.eval()
    assert not model.training and not inner.training and not inner.bn.training
    model.train()
    assert model.training and inner.training and inner.drop.training


def test_double_reexports_and_matches_torch():
    model, reference = ort_and_torch(MLP())
    x = torch.randn(5, 4)
    model(x)
    model.double()
    reference.double()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    xd = x.double()
    out = model(xd)
    expected = reference(xd)
    assert out.dtype == torch.float64
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)
    assert model.state_machine.counters.exports == 2
    assert "dtype" in model.state_machine.history[-2].reason


def test_double_with_integer_inputs_reexports():
    reference = EmbeddingModel()
    model = ORTModule(copy.deepcopy(reference))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert_close(model(ids), reference(ids))
    model.to(torch.float64)
    reference.to(torch.float64)
    # The parameters' dtype is part of the graph key: a new graph is exported. ORT's CPU build lacks a float64 kernel
    # for its matmul's gradient: the module holding it is repaired into a region that runs in PyTorch, saying why.
    out = model(ids)
    assert out.dtype == torch.float64
    assert_close(out, reference(ids))
    assert any(t.action == "export" and "dtype changed" in t.reason for t in model.state_machine.history)
    assert any("FusedMatMul" in r.reason for r in model.repairs)
    assert model.state_machine.counters.fallbacks == 0


def test_float64_training_routes_the_module_whose_kernel_is_missing():
    reference = EmbeddingModel().to(torch.float64)
    model = ORTModule(copy.deepcopy(reference))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = model(ids)
    expected = reference(ids)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)
    assert model.state_machine.counters.fallbacks == 0
    (repair,) = model.repairs
    assert repair.kind == "region" and "FusedMatMul" in repair.reason


def test_float64_training_falls_back_naming_the_missing_kernel_without_regions(monkeypatch):
    monkeypatch.setenv("ORTCORE_DISABLE_PLUGINS", "region_routing")
    reference = EmbeddingModel().to(torch.float64)
    model = ORTModule(copy.deepcopy(reference))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.warns(RuntimeWarning, match="FusedMatMul"):
        out = model(ids)
    assert_close(out, reference(ids))
    assert model.state_machine.counters.fallbacks == 1


def test_attribute_access_falls_through_to_wrapped_model():
    inner = MLP()
    model = wrap(inner)
    assert model.some_attr == "mlp"
    assert model.fc1 is inner.fc1
    assert model.describe() == "mlp with 4 inputs"
    assert model.module is inner
    with pytest.raises(AttributeError):
        model.no_such_attribute  # noqa: B018


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0) -> torch.Tensor:
        y = self.fc(x) * scale
        return y if mask is None else y * mask


def test_attribute_assignment_falls_through_and_reexports():
    model, reference = ort_and_torch(MLP())
    x = torch.randn(5, 4)
    assert_close(model(x), reference(x))
    model.some_attr = "renamed"
    assert model.module.some_attr == "renamed"
    torch.manual_seed(1)
    model.fc2 = nn.Linear(8, 3, bias=False)  # a new head, as when fine-tuning
    torch.manual_seed(1)
    reference.fc2 = nn.Linear(8, 3, bias=False)
    assert model.module.fc2 is model.fc2
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    out = model(x)
    expected = reference(x)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)


class RootParameter(nn.Module):
    """A model with a parameter of its own (not in a submodule) and a dropout."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x * self.scale))


def test_module_tree_is_the_models():
    """named_children/named_modules/modules/children are the model's, as named_parameters are: DDP, DeepSpeed (tied
    parameter names in checkpoints) and init functions walk the model's tree. The wrapper stands at its root, in
    the model's place (an engine applied to the ORTModule, FSDP2's fully_shard, finds itself there), with the same
    name; walking each module's own parameters (recurse=False) finds every parameter once, as in the model."""
    inner = RootParameter()
    model = ORTModule(inner)
    expected = [(n, model if m is inner else m) for n, m in inner.named_modules()]
    assert [(n, m) for n, m in model.named_modules()] == expected
    assert [(n, m) for n, m in model.named_children()] == list(inner.named_children())
    assert list(model.modules()) == [m for _, m in expected] and list(model.children()) == list(inner.children())
    own = [p for m in model.modules() for _, p in m.named_parameters(recurse=False)]
    assert own == [p for m in inner.modules() for _, p in m.named_parameters(recurse=False)]
    assert [n for n, _ in model.named_modules(prefix="m")] == ["m", "m.fc", "m.drop"]
    seen = []
    assert model.apply(seen.append) is model
    assert seen == [inner.fc, inner.drop, inner]
    assert model.eval() is model and not model.training
    assert not any(m.training for m in inner.modules())
    model.train()
    assert model.training and all(m.training for m in inner.modules())
    with pytest.raises(ValueError, match="boolean"):
        model.train("yes")
    assert model.double() is model
    assert inner.scale.dtype == inner.fc.weight.dtype == torch.float64  # the root's own parameter too
    model.float()
    x = torch.randn(3, 4)
    reference = copy.deepcopy(inner)
    model.eval()
    reference.eval()
    assert_close(model(x), reference(x))


def test_forward_signature_equals_wrapped_model():
    inner = KeywordModel()
    model = wrap(inner)
    assert inspect.signature(model.forward) == inspect.signature(inner.forward)
    assert list(inspect.signature(model.forward).parameters) == ["x", "mask", "scale"]


def _train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_keeps_training_like_torch(how: str):
    model, reference = ort_and_torch(MLP())
    x = torch.randn(5, 4)
    _train_step(model, x)  # the original has a graph and a session before it is copied
    _train_step(reference, x)
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    ref_copy = copy.deepcopy(reference)
    assert isinstance(copied, ORTModule)
    assert all(p is not q for p, q in zip(copied.parameters(), model.parameters()))
    copied.zero_grad()
    ref_copy.zero_grad()
    x2 = torch.randn(7, 4)
    assert_close(_train_step(copied, x2), _train_step(ref_copy, x2))
    assert_grads_match(copied, ref_copy)
    assert copied.state_machine.counters.fallbacks == 0
    assert copied.state_machine.counters.exports >= 1
    assert copied.some_attr == "mlp"
    assert inspect.signature(copied.forward) == inspect.signature(ref_copy.forward)
    # the original still trains on its own parameters
    assert_close(_train_step(model, x2), _train_step(reference, x2))


def test_optimizer_and_scheduler_train_without_reexport():
    model, reference = ort_and_torch(MLP())
    opts, scheds = [], []
    for m in (model, reference):
        opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01)
        opts.append(opt)
        scheds.append(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    for step in range(6):
        x = torch.randn(8, 4)
        losses = []
        for m, opt, sched in zip((model, reference), opts, scheds):
            opt.zero_grad()
            loss = _train_step(m, x)
            opt.step()
            sched.step()
            losses.append(loss)
        assert_close(losses[0], losses[1], msg=f"loss at step {step}")
        assert_params_match(model, reference)
    counters = model.state_machine.counters
    assert (counters.exports, counters.builds, counters.fallbacks) == (1, 1, 0)


# -- training semantics ---------------------------------------------------------------------------------------------


def test_gradients_accumulate_across_backward_calls():
    model, reference = ort_and_torch(MLP())
    for _ in range(3):
        x = torch.randn(4, 4)
        _train_step(model, x)
        _train_step(reference, x)
    assert_grads_match(model, reference)
    assert model.state_machine.counters.exports == 1


def test_input_requiring_grad_gets_torch_gradient():
    model, reference = ort_and_torch(MLP())
    x = torch.randn(5, 4)
    x_ort = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    _train_step(model, x_ort)
    _train_step(reference, x_ref)
    assert_close(x_ort.grad, x_ref.grad)
    assert_grads_match(model, reference)


def test_frozen_parameters_get_no_gradient():
    model, reference = ort_and_torch(MLP())
    for m in (model, reference):
        m.fc1.weight.requires_grad_(False)
        m.fc2.bias.requires_grad_(False)
    x = torch.randn(5, 4)
    assert_close(_train_step(model, x), _train_step(reference, x))
    assert model.fc1.weight.grad is None and model.fc2.bias.grad is None
    assert_grads_match(model, reference)


class ManyOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.other = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor):
        y = self.fc(x)
        return y, y.argmax(-1), self.other(x)


def test_backward_through_one_output_with_unused_and_integer_outputs():
    model, reference = ort_and_torch(ManyOutputs())
    x = torch.randn(6, 4)
    out = model(x)
    expected = reference(x)
    for a, e in zip(out, expected, strict=True):
        assert a.dtype == e.dtype
        assert a.requires_grad == e.requires_grad
        assert_close(a, e)
    assert out[1].dtype == torch.int64
    out[0].sum().backward()
    expected[0].sum().backward()
    for name in ("weight", "bias"):
        assert_close(getattr(model.fc, name).grad, getattr(reference.fc, name).grad, msg=f"fc.{name}")


def test_parameters_reached_only_by_unused_outputs_get_no_gradient():
    model, reference = ort_and_torch(ManyOutputs())
    x = torch.randn(6, 4)
    model(x)[0].sum().backward()
    reference(x)[0].sum().backward()
    assert reference.other.weight.grad is None
    assert_grads_match(model, reference)  # a zero gradient would still move other.* under AdamW's weight decay


class DetachedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        y = self.fc(x)
        return y, y.detach() * 2


def test_detached_output_does_not_require_grad():
    model, reference = ort_and_torch(DetachedOutput())
    x = torch.randn(6, 4)
    out, detached = model(x)
    expected, expected_detached = reference(x)
    assert_close(detached, expected_detached)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)
    assert detached.requires_grad is expected_detached.requires_grad is False


class DetachInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return (y * y.detach()).sum()


def test_detach_inside_a_gradient_path_runs_in_ort_and_matches_torch():
    model, reference = ort_and_torch(DetachInside())
    x = torch.randn(6, 4)
    model(x).backward()
    reference(x).backward()
    assert_grads_match(model, reference)
    assert model.state_machine.counters.fallbacks == 0


def test_no_grad_builds_no_gradient_graph_and_matches_torch():
    model, reference = ort_and_torch(MLP())
    x = torch.randn(5, 4)
    _train_step(model, x)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        out = model(x)
        expected = reference(x)
    assert not out.requires_grad and out.grad_fn is None
    assert_close(out, expected)
    assert all(p.grad is None for p in model.parameters())
    counters = model.state_machine.counters
    assert (counters.exports, counters.builds) == (1, 2)
    last = model.state_machine.history[-1]
    assert last.action == "build" and "no_grad" in last.reason


def test_inference_mode_matches_torch():
    model, reference = ort_and_torch(MLP())
    x = torch.randn(5, 4)
    with torch.inference_mode():
        out = model(x)
        expected = reference(x)
    assert not out.requires_grad
    assert_close(out, expected)


def test_fully_frozen_model_runs_without_gradient_graph():
    model, reference = ort_and_torch(MLP())
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(5, 4)
    out = model(x)
    assert not out.requires_grad
    assert_close(out, reference(x))
    x_ort = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    model(x_ort).sum().backward()
    reference(x_ref).sum().backward()
    assert_close(x_ort.grad, x_ref.grad)
    assert all(p.grad is None for p in model.parameters())


def test_backward_twice_with_retain_graph_accumulates_like_torch():
    model, reference = ort_and_torch(MLP())
    x = torch.randn(5, 4)
    for m in (model, reference):
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_grads_match(model, reference)


def test_eval_mode_matches_torch():
    dropout_only = Regularized()
    dropout_only.bn = nn.Identity()  # eval-mode batch norm with gradients has its own test below
    model, reference = ort_and_torch(dropout_only)
    model.eval()
    reference.eval()
    x = torch.randn(8, 4)
    out = model(x)
    expected = reference(x)
    assert_close(out, expected)  # dropout is off in eval
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)
    with torch.no_grad():
        assert_close(model(x), reference(x))


def test_eval_mode_batch_norm_with_gradients_uses_running_statistics():
    model, reference = ort_and_torch(Regularized())
    reference.bn.running_mean.normal_()
    reference.bn.running_var.uniform_(0.5, 2.0)
    model.load_state_dict(reference.state_dict())
    for m in (model, reference):
        m.eval()
    x = torch.randn(8, 4)
    out = model(x)
    expected = reference(x)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(model.bn, name), getattr(reference.bn, name)), name


def test_train_mode_batch_norm_matches_torch():
    model, reference = ort_and_torch(Regularized())
    for m in (model, reference):
        m.drop.p = 0.0
    for _ in range(3):
        x = torch.randn(8, 4)
        assert_close(model(x), reference(x))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(getattr(model.bn, name), getattr(reference.bn, name), msg=name)


# -- IO schema ------------------------------------------------------------------------------------------------------


class Arguments(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 2.0, *, bias: torch.Tensor | None = None):
        out = self.fc(x) * scale + y
        return out if bias is None else out + bias


def test_positional_keyword_and_default_arguments_match_torch():
    model, reference = ort_and_torch(Arguments())
    x, y, b = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4)
    calls = [
        ((x, y), {}),
        ((x,), {"y": y}),
        ((), {"x": x, "y": y}),
        ((x, y, 2.0), {}),  # the default, spelled out
        ((x, y), {"scale": 0.5}),
        ((x, y), {"bias": b}),
    ]
    for _ in range(2):
        for args, kwargs in calls:
            assert_close(model(*args, **kwargs), reference(*args, **kwargs), msg=f"{len(args)} args, {sorted(kwargs)}")
    # Each spelling of a call is traced as it was made (a decorator may read kwargs): one graph each, reused when the
    # same spelling comes again.
    assert model.state_machine.counters.exports == len(calls)


def hf_style_kwargs(forward):
    """Like Hugging Face's output decorators: reads ``use_cache`` from ``kwargs`` and passes it on as a keyword, so
    the forward must receive it as the caller passed it (turned positional, it arrives twice)."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        use_cache = kwargs.pop("use_cache", None)
        kwargs["use_cache"] = bool(use_cache) if use_cache is not None else self.default_use_cache
        return forward(self, *args, **kwargs)

    return wrapper


class DecoratedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.default_use_cache = False

    @hf_style_kwargs
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, use_cache: bool | None = None):
        y = self.fc(x)
        if mask is not None:
            y = y * mask
        return {"out": y, "cache": y.detach() * 2} if use_cache else {"out": y}


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x, mask: m(x, use_cache=True),
        lambda m, x, mask: m(x, mask=mask, use_cache=True),
        lambda m, x, mask: m(x=x, use_cache=False),
        lambda m, x, mask: m(x, mask),  # use_cache left to the decorator's default
    ],
    ids=["keyword", "positional-by-keyword-and-keyword", "all-keywords", "default-omitted"],
)
def test_decorator_reading_kwargs_sees_the_call_as_made(call):
    model, reference = ort_and_torch(DecoratedForward())
    x, mask = torch.randn(3, 4), (torch.rand(3, 4) > 0.5).float()
    out, expected = call(model, x, mask), call(reference, x, mask)
    assert list(out) == list(expected)
    assert_close(out, expected)
    out["out"].sum().backward()
    expected["out"].sum().backward()
    assert_grads_match(model, reference)


class KeywordOnlyAndVarKeyword(nn.Module):
    # On the class, not the instance: ORTModule traces a deep copy of the model.
    seen: ClassVar[list[tuple[int, tuple[str, ...]]]] = []

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor, scale: torch.Tensor, **kwargs: torch.Tensor):
        type(self).seen.append((len(rest), tuple(kwargs)))  # what the forward received
        y = self.fc(x) * scale
        for r in rest:
            y = y + r
        for value in kwargs.values():
            y = y * value
        return y


def test_keyword_only_var_positional_and_var_keyword_arguments_reach_forward_as_passed():
    model, reference = ort_and_torch(KeywordOnlyAndVarKeyword())
    x, r, scale = torch.randn(3, 4), torch.randn(3, 4), torch.rand(4) + 0.5
    attention_mask, weights = (torch.rand(3, 4) > 0.3).float(), torch.rand(3, 4)
    # keyword order is the caller's: the forward iterates kwargs
    KeywordOnlyAndVarKeyword.seen.clear()
    out = model(x, r, weights=weights, scale=scale, attention_mask=attention_mask)
    expected = reference(x, r, weights=weights, scale=scale, attention_mask=attention_mask)
    assert_close(out, expected)
    # every call of the forward (the trace, a gradient audit, PyTorch's own) received the arguments as passed
    assert len(KeywordOnlyAndVarKeyword.seen) >= 2
    assert set(KeywordOnlyAndVarKeyword.seen) == {(1, ("weights", "attention_mask"))}
    graph, _ = model.state_machine.current
    assert graph.user_input_names == ["x", "rest.0", "scale", "kwargs.weights", "kwargs.attention_mask"]
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)


class OnlyVarKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, **kwargs: torch.Tensor):
        return self.fc(kwargs["input_ids"]) * kwargs.get("attention_mask", 1.0)


def test_var_keyword_forward_gets_its_keywords():
    model, reference = ort_and_torch(OnlyVarKeyword())
    x, mask = torch.randn(3, 4), (torch.rand(3, 4) > 0.5).float()
    assert_close(model(input_ids=x, attention_mask=mask), reference(input_ids=x, attention_mask=mask))
    assert_close(model(input_ids=x), reference(input_ids=x))
    graph, _ = model.state_machine.current
    assert graph.user_input_names == ["kwargs.input_ids"]


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, pair: tuple, items: list, table: dict) -> torch.Tensor:
        a, (b, c) = pair
        out = self.fc(a) + b * c
        for item in items:
            out = out + item
        return out * table["scale"] + table["shift"]["value"]


def test_nested_tuple_list_dict_inputs_match_torch():
    model, reference = ort_and_torch(Nested())
    x = torch.randn(3, 4)
    pair = (x, (torch.randn(3, 4), torch.randn(4)))
    items = [torch.randn(4), torch.randn(3, 4)]
    table = {"scale": torch.tensor(1.5), "shift": {"value": torch.randn(1, 4)}}
    out = model(pair, items, table)
    expected = reference(pair, items, table)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)


def test_none_arguments_match_torch():
    model, reference = ort_and_torch(KeywordModel())
    x, mask = torch.randn(3, 4), (torch.rand(3, 4) > 0.5).float()
    assert_close(model(x, None), reference(x, None))
    assert_close(model(x, mask), reference(x, mask))
    assert_close(model(x, mask=None, scale=3.0), reference(x, mask=None, scale=3.0))


Pair = collections.namedtuple("Pair", ["logits", "extras"])


class StructuredOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        y = self.fc(x)
        return {"pair": Pair(y, [y.sum(-1), None]), "count": 3, "nested": (y * 2, {"mean": y.mean()})}


def test_dict_namedtuple_and_constant_outputs_restored():
    model, reference = ort_and_torch(StructuredOutputs())
    x = torch.randn(5, 4)
    out = model(x)
    expected = reference(x)
    assert isinstance(out["pair"], Pair)
    assert isinstance(out["pair"].extras, list) and out["pair"].extras[1] is None
    assert out["count"] == 3
    assert list(out) == list(expected)
    assert_close(out, expected)
    (out["pair"].logits.sum() + out["nested"][1]["mean"]).backward()
    (expected["pair"].logits.sum() + expected["nested"][1]["mean"]).backward()
    assert_grads_match(model, reference)


@dataclasses.dataclass
class DataclassOutput:
    logits: torch.Tensor
    doubled: torch.Tensor


class ReturnsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> DataclassOutput:
        y = self.fc(x)
        return DataclassOutput(y, y * 2)


def test_dataclass_output_restored():
    model, reference = ort_and_torch(ReturnsDataclass())
    x = torch.randn(5, 4)
    out = model(x)
    expected = reference(x)
    assert isinstance(out, DataclassOutput)
    assert_close(out.logits, expected.logits)
    assert_close(out.doubled, expected.doubled)
    out.doubled.sum().backward()
    expected.doubled.sum().backward()
    assert_grads_match(model, reference)


class ReturnsModelOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutput

        y = self.fc(x)
        return BaseModelOutput(last_hidden_state=y, hidden_states=(x, y))


def test_hugging_face_model_output_restored():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    model, reference = ort_and_torch(ReturnsModelOutput())
    x = torch.randn(5, 4)
    out = model(x)
    expected = reference(x)
    assert type(out) is BaseModelOutput
    assert list(out.keys()) == list(expected.keys()) == ["last_hidden_state", "hidden_states"]
    assert out.attentions is None
    assert_close(out[0], expected[0])
    assert_close(out.hidden_states, expected.hidden_states)
    out.last_hidden_state.sum().backward()
    expected.last_hidden_state.sum().backward()
    assert_grads_match(model, reference)


class PassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.fc(x), y, y * 2, self.fc(x).argmax(-1)


def test_outputs_computed_without_trainable_inputs_do_not_require_grad_like_torch():
    model, reference = ort_and_torch(PassThrough())
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    outputs, expected = model(x, y), reference(x, y)
    assert [o.requires_grad for o in outputs] == [o.requires_grad for o in expected] == [True, False, False, False]
    for out, ref in zip(outputs, expected):
        assert_close(out, ref)
    outputs[0].sum().backward()
    expected[0].sum().backward()
    assert_grads_match(model, reference)


# -- outputs of classes pytree does not know --------------------------------------------------------------------------


class RunInfo:
    """A result class pytree does not know, holding no tensor."""

    def __init__(self, mode: str, layers: list[int]):
        self.mode = mode
        self.layers = layers

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunInfo) and (self.mode, self.layers) == (other.mode, other.layers)


class ReturnsRunInfo(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mode: str = "train"):
        return self.fc(x), RunInfo(mode, [4, 3])


def test_output_object_without_tensors_is_returned_as_torch_returns_it():
    model, reference = ort_and_torch(ReturnsRunInfo())
    x = torch.randn(5, 4)
    (out, info), (expected, expected_info) = model(x, "eval"), reference(x, "eval")
    assert type(info) is RunInfo and info == expected_info
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(model, reference)
    # a new object per call, as in PyTorch: one call's change does not reach the next
    info.layers.append(99)
    _, again = model(x, "eval")
    assert again == expected_info and again is not info
    # its value is the trace's for the call's constants: another mode is another graph
    _, other = model(x, "train")
    assert other == reference(x, "train")[1]
    assert model.state_machine.counters.exports == 2


class Holder:
    """A class pytree does not know, holding tensors."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor):
        self.logits = logits
        self.mask = mask


class ReturnsHolder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Holder:
        y = self.fc(x)
        return Holder(y, (y > 0).long())


def test_output_object_holding_tensors_is_refused_naming_the_class_and_the_registration():
    model = wrap(ReturnsHolder())
    with pytest.raises(ortcore.UnsupportedDataError) as raised:
        model(torch.randn(5, 4))
    message = str(raised.value)
    assert "ORTModule does not support the following model output type" in message  # upstream's words
    assert f"{Holder.__module__}.Holder" in message
    assert "attribute 'logits' is a Tensor" in message or "attribute 'mask' is a Tensor" in message
    assert "torch.utils._pytree.register_pytree_node(Holder" in message


class RegisteredHolder(Holder):
    pass


def test_output_object_registered_with_pytree_trains_like_torch():
    import torch.utils._pytree as pytree

    pytree.register_pytree_node(
        RegisteredHolder,
        lambda h: ([h.logits, h.mask], None),
        lambda children, _: RegisteredHolder(*children),
    )

    class ReturnsRegistered(ReturnsHolder):
        def forward(self, x: torch.Tensor) -> RegisteredHolder:
            y = self.fc(x)
            return RegisteredHolder(y, (y > 0).long())

    model, reference = ort_and_torch(ReturnsRegistered())
    x = torch.randn(5, 4)
    out, expected = model(x), reference(x)
    assert type(out) is RegisteredHolder
    assert_close(out.logits, expected.logits)
    assert torch.equal(out.mask, expected.mask)
    out.logits.sum().backward()
    expected.logits.sum().backward()
    assert_grads_match(model, reference)


class ReturnsConstants(nn.Module):
    """Outputs whose values do not depend on the inputs, as a Hugging Face cache returns its maximum length: the
    exporters fold them into constants, which ORT's gradient builder refuses as graph outputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        return self.fc(x), torch.tensor(4096).to("cpu"), x, {"ones": torch.ones(2, 3)}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_constant_tensor_outputs_train_in_ort_and_survive_the_export_cache(exporter: str):
    from ortcore.graph import ExportedGraph

    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    model, reference = ort_and_torch(ReturnsConstants(), exporter=exporter)
    for batch in (5, 7):
        x = torch.randn(batch, 4)
        out, expected = model(x), reference(x)
        assert_close(out, expected)
        assert out[1].dtype == torch.int64 and out[3]["ones"].dtype == torch.float32
        out[3]["ones"].add_(1)  # each call gets its own tensor, as in PyTorch
        assert_close(model(x)[3]["ones"], torch.ones(2, 3))
        out[0].square().sum().backward()
        expected[0].square().sum().backward()
        assert_grads_match(model, reference)
    assert model.fallback_reason is None
    graph, _session = model.state_machine.current
    assert len(graph.model.graph.output) >= 2  # the linear's output and x; the constants are not ORT's
    again = ExportedGraph.from_bytes(graph.to_bytes(), model)
    assert_close(
        again.output_schema.restore([torch.zeros(1, 3), torch.zeros(1, 4)]),
        graph.output_schema.restore([torch.zeros(1, 3), torch.zeros(1, 4)]),
    )


class ViewOutputs(nn.Module):
    """Outputs ONNX Runtime makes as views of another buffer (Squeeze, Reshape), beside a loss computed from them."""

    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.how = how

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        y = self.fc(x)
        logits = y.squeeze(-1) if self.how == "squeeze" else (y * 2).reshape(x.shape[0], x.shape[1])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
        return loss, logits


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("how", ["squeeze", "reshape"])
def test_outputs_that_are_views_keep_their_values_after_backward(how: str, exporter: str):
    """A user keeps the logits past backward() (to compute an accuracy, say): ORT frees the buffer a view output
    points into after the forward, and the backward's allocations overwrote the logits before the core copied them."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    model, reference = ort_and_torch(ViewOutputs(how), exporter=exporter)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, labels = torch.randn(4, 12, 8, generator=generator), torch.randint(0, 2, (4, 12), generator=generator)
        (loss, logits), (expected_loss, expected_logits) = model(x, labels), reference(x, labels)
        loss.backward()
        expected_loss.backward()
        assert_close(logits, expected_logits)  # read after the backward
        assert_close(loss, expected_loss)
        assert_grads_match(model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert model.fallback_reason is None


class RepeatsOutputs(nn.Module):
    """One value returned twice, also read by later ops, beside its detached copy, a view of it and the input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor):
        y = self.fc(x)
        return y, y.detach(), y.transpose(0, 1), x, y, (y * 2).sum()


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_value_returned_twice_and_read_again_trains_like_torch(exporter: str):
    """Each graph output the graph also reads gets an Identity of its own (compute_optimizer): a value returned twice
    got two Identity nodes of one name and ORT refused the graph ("two nodes with same node name")."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    model, reference = ort_and_torch(RepeatsOutputs(), exporter=exporter)
    x = torch.randn(3, 4)
    out, expected = model(x), reference(x)
    assert_close(out, expected)
    (out[0].square().sum() + out[4].sum() + out[5]).backward()
    (expected[0].square().sum() + expected[4].sum() + expected[5]).backward()
    assert_grads_match(model, reference)
