"""fused_adam: FusedAdam equals the reference optimizer of each AdamWMode on real small models, resumes from its
state_dict, updates bf16 parameters in fp32 math, and is reached through ``ortcore.optim`` only when enabled.

Tolerances: fp32 parameters after 100 steps are within 1e-6 relative (to the tensor's largest value) of
``torch.optim.Adam``/``AdamW`` or of the transformers formula written out below; bf16 parameters are within one bf16
rounding step (2**-8 relative) of a reference that upcasts them, updates them with ``torch.optim.AdamW`` on fp32
moments, and rounds back; an ORTModule loss curve is within 1e-5 relative of eager.
"""

from __future__ import annotations

import copy
import importlib
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ortcore_plugins.fused_adam as plugin
from ortcore import optim
from ortcore.config import Config
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginHost, set_host
from ortcore_plugins.fused_adam import AdamWMode, FusedAdam

STEPS = 100
LR, WD, EPS = 1e-3, 0.01, 1e-6


# -- models and a training loop ----------------------------------------------------------------------------------


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    )


TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(1234))


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    return x, torch.tanh(x @ TEACHER)


def mlp_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = mlp_batch(step)
    return F.mse_loss(model(x), y)


def tiny_bert() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


def bert_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 100, (2, 8), generator=g)
    return model(input_ids=ids, labels=ids).loss


MODELS = {"mlp": (mlp, mlp_loss), "bert": (tiny_bert, bert_loss)}


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_pair(model, optimizer, expected, reference_optimizer, loss_fn, steps: int) -> list[float]:
    """Train ``model``; feed ``expected`` the very same gradients, so that only the optimizers differ (a model's own
    gradients would amplify last-bit rounding differences step after step)."""
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        for p, e in zip(model.parameters(), expected.parameters()):
            e.grad = None if p.grad is None else p.grad.detach().clone()
        optimizer.step()
        reference_optimizer.step()
        losses.append(loss.item())
    return losses


class TransformersAdamW(torch.optim.Optimizer):
    """The classic transformers.AdamW formula, written out per parameter."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bc=bias_correction))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["t"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["t"] += 1
                t, m, v = state["t"], state["m"], state["v"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = group["lr"]
                if group["bc"]:
                    step_size = step_size * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-step_size)
                p.add_(p, alpha=-group["lr"] * group["weight_decay"])


def reference(mode: AdamWMode, params, fused: bool | None = None, **kwargs) -> torch.optim.Optimizer:
    """The optimizer a mode equals; for torch's formulas on CPU, torch's fused variant (the kernel FusedAdam calls)
    unless ``fused=False`` asks for the default per-tensor loop."""
    if mode == AdamWMode.ADAM_L2_REGULARIZATION:
        return torch.optim.Adam(params, fused=True if fused is None else fused, **kwargs)
    if mode == AdamWMode.ADAMW_TORCH:
        return torch.optim.AdamW(params, fused=True if fused is None else fused, **kwargs)
    return TransformersAdamW(params, **kwargs)


def assert_params_close(actual: torch.nn.Module, expected: torch.nn.Module, rtol: float) -> None:
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters()):
        scale = e.detach().abs().max().clamp_min(1e-12)
        error = ((a.detach().float() - e.detach().float()).abs().max() / scale).item()
        assert error <= rtol, f"{name}: relative error {error:.3g} > {rtol}"


# -- numerics ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("mode", list(AdamWMode), ids=lambda m: m.name)
def test_matches_reference_of_each_mode_after_100_steps(model_name, mode):
    make, loss_fn = MODELS[model_name]
    model = make()
    expected = copy.deepcopy(model)
    fused = FusedAdam(model.parameters(), lr=LR, eps=EPS, weight_decay=WD, adam_w_mode=mode)
    ref = reference(mode, expected.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    losses = train_pair(model, fused, expected, ref, loss_fn, STEPS)
    assert sum(losses[-10:]) < sum(losses[:10])
    assert_params_close(model, expected, 1e-6)


@pytest.mark.parametrize("mode", [AdamWMode.ADAM_L2_REGULARIZATION, AdamWMode.ADAMW_TORCH], ids=lambda m: m.name)
def test_torch_formulas_match_torch_default_loop_within_its_fused_rounding(mode):
    """torch's fused CPU kernel and its default per-tensor loop round differently (the same formula): after 100
    steps they differ by up to a few 1e-6 relative on small tensors with tiny gradients; FusedAdam is within 1e-5."""
    model = tiny_bert()
    expected = copy.deepcopy(model)
    fused = FusedAdam(model.parameters(), lr=LR, eps=EPS, weight_decay=WD, adam_w_mode=mode)
    ref = reference(mode, expected.parameters(), fused=False, lr=LR, eps=EPS, weight_decay=WD)
    train_pair(model, fused, expected, ref, bert_loss, STEPS)
    assert_params_close(model, expected, 1e-5)


@pytest.mark.parametrize("mode", list(AdamWMode), ids=lambda m: m.name)
def test_without_bias_correction_matches_the_formula(mode):
    model = mlp()
    expected = copy.deepcopy(model)
    fused = FusedAdam(model.parameters(), lr=LR, bias_correction=False, weight_decay=WD, adam_w_mode=mode)
    train(model, fused, mlp_loss, 20)
    # Without bias correction, torch's formulas and the transformers one differ only in where the decay goes.
    ref_params = list(expected.parameters())
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref_params]
    for step in range(20):
        for p in ref_params:
            p.grad = None
        mlp_loss(expected, step).backward()
        with torch.no_grad():
            for p, (m, v) in zip(ref_params, states):
                g = p.grad + WD * p if mode == AdamWMode.ADAM_L2_REGULARIZATION else p.grad
                if mode == AdamWMode.ADAMW_TORCH:
                    p.mul_(1 - LR * WD)
                m.lerp_(g, 0.1)
                v.mul_(0.999).addcmul_(g, g, value=0.001)
                p.addcdiv_(m, v.sqrt() + 1e-6, value=-LR)
                if mode == AdamWMode.ADAMW_TRANSFORMERS:
                    p.add_(p, alpha=-LR * WD)
    assert_params_close(model, expected, 1e-6)


@pytest.mark.parametrize("mode", list(AdamWMode), ids=lambda m: m.name)
def test_param_groups_with_their_own_lr_and_weight_decay(mode):
    model = mlp()
    expected = copy.deepcopy(model)

    def groups(m):
        return [
            {"params": m[0].parameters(), "lr": 2e-3, "weight_decay": 0.1},
            {"params": m[2].parameters()},
            {"params": m[4].parameters(), "lr": 5e-4, "weight_decay": 0.0},
        ]

    fused = FusedAdam(groups(model), lr=LR, weight_decay=WD, adam_w_mode=mode)
    ref = reference(mode, groups(expected), fused=False, lr=LR, eps=EPS, weight_decay=WD)
    train_pair(model, fused, expected, ref, mlp_loss, 30)
    assert_params_close(model, expected, 1e-6)
    assert [g["lr"] for g in fused.param_groups] == [2e-3, LR, 5e-4]


@pytest.mark.parametrize("mode", list(AdamWMode), ids=lambda m: m.name)
def test_state_dict_round_trip_resumes_identically(mode):
    model = mlp()
    fused = FusedAdam(model.parameters(), lr=LR, weight_decay=WD, adam_w_mode=mode)
    train(model, fused, mlp_loss, 10)
    resumed_model = copy.deepcopy(model)
    resumed = FusedAdam(resumed_model.parameters(), lr=0.5, adam_w_mode=AdamWMode.ADAMW_TORCH)
    resumed.load_state_dict(copy.deepcopy(fused.state_dict()))
    assert resumed.param_groups[0]["adam_w_mode"] == mode and resumed.param_groups[0]["lr"] == LR
    train(model, fused, mlp_loss, 10, start=10)
    train(resumed_model, resumed, mlp_loss, 10, start=10)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_saved_state_loads_with_weights_only_and_resumes(tmp_path):
    """The mode is saved as a plain int: torch.load's default weights_only=True loads the file (no ortcore class in
    it), and the loaded state resumes exactly."""
    model = mlp()
    fused = FusedAdam(model.parameters(), lr=LR, weight_decay=WD, adam_w_mode=AdamWMode.ADAMW_TORCH)
    train(model, fused, mlp_loss, 5)
    torch.save(fused.state_dict(), tmp_path / "optim.pt")
    state = torch.load(tmp_path / "optim.pt", weights_only=True)
    assert type(state["param_groups"][0]["adam_w_mode"]) is int
    resumed_model = copy.deepcopy(model)
    resumed = FusedAdam(resumed_model.parameters())
    resumed.load_state_dict(state)
    train(model, fused, mlp_loss, 5, start=5)
    train(resumed_model, resumed, mlp_loss, 5, start=5)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_bf16_parameters_are_updated_in_fp32_math():
    model = mlp().to(torch.bfloat16)
    expected = copy.deepcopy(model)
    fused = FusedAdam(model.parameters(), lr=LR, eps=EPS, weight_decay=WD, adam_w_mode=AdamWMode.ADAMW_TORCH)
    masters = [p.detach().float() for p in expected.parameters()]
    ref = torch.optim.AdamW(masters, lr=LR, eps=EPS, weight_decay=WD)

    def loss_fn(m, step):
        x, y = mlp_batch(step)
        return F.mse_loss(m(x.bfloat16()).float(), y)

    for step in range(30):
        fused.zero_grad()
        loss_fn(model, step).backward()
        fused.step()
        for p in expected.parameters():
            p.grad = None
        loss_fn(expected, step).backward()
        with torch.no_grad():  # the fp32-master reference: upcast, AdamW on fp32 moments, round back
            for master, p in zip(masters, expected.parameters()):
                master.copy_(p.float())
                master.grad = p.grad.float()
            ref.step()
            for master, p in zip(masters, expected.parameters()):
                p.copy_(master.bfloat16())
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        state = fused.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert_params_close(model, expected, 2**-8)
    # The fp32 moments survive a state_dict round trip (torch would cast them to the parameter's bf16).
    resumed = FusedAdam(copy.deepcopy(model).parameters())
    resumed.load_state_dict(copy.deepcopy(fused.state_dict()))
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in resumed.state.values())


def test_parameters_without_gradients_are_untouched():
    model = mlp()
    frozen = model[4].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    fused = FusedAdam(model.parameters(), lr=LR, weight_decay=WD)
    train(model, fused, mlp_loss, 5)
    assert torch.equal(frozen, before) and frozen not in fused.state
    assert all(int(fused.state[p]["step"]) == 5 for p in model.parameters() if p.requires_grad)


def test_zero_grad_follows_set_grad_none():
    model = mlp()
    mlp_loss(model, 0).backward()
    FusedAdam(model.parameters(), set_grad_none=False).zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    FusedAdam(model.parameters()).zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, r"lr=-1.0 is not allowed; expected a number >= 0"),
        ({"eps": -1e-8}, r"eps=-1e-08 is not allowed"),
        ({"weight_decay": -0.1}, r"weight_decay=-0.1 is not allowed"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]=1.0 is not allowed; expected 0 <= beta < 1"),
        ({"betas": (0.9,)}, r"betas=\(0.9,\) is not allowed; expected a pair"),
        ({"adam_w_mode": 3}, r"adam_w_mode=3 is not allowed; allowed: AdamWMode.ADAM_L2_REGULARIZATION \(0\)"),
        ({"bias_correction": 1}, r"bias_correction=1 is not allowed; expected a bool"),
        ({"set_grad_none": "yes"}, r"set_grad_none='yes' is not allowed; expected a bool"),
    ],
)
def test_bad_arguments_are_rejected_with_the_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedAdam(mlp().parameters(), **kwargs)


def test_bad_param_group_is_rejected():
    model = mlp()
    fused = FusedAdam(model[0].parameters())
    with pytest.raises(ValueError, match="lr=-0.1 is not allowed"):
        fused.add_param_group({"params": model[2].parameters(), "lr": -0.1})


def test_adamw_mode_values():
    assert [(m.name, int(m)) for m in AdamWMode] == [
        ("ADAM_L2_REGULARIZATION", 0),
        ("ADAMW_TRANSFORMERS", 1),
        ("ADAMW_TORCH", 2),
    ]
    assert isinstance(FusedAdam(mlp().parameters()), torch.optim.Optimizer)


# -- ortcore.optim and the hook ------------------------------------------------------------------------------------


def test_ortcore_optim_offers_fused_adam_through_the_hook(ortcore_host):
    host = ortcore_host({plugin.NAME: plugin})
    previous = set_host(host)
    try:
        namespace: dict = {}
        exec("from ortcore.optim import FusedAdam, AdamWMode", namespace)
        assert namespace["FusedAdam"] is FusedAdam and namespace["AdamWMode"] is AdamWMode
        with pytest.raises(
            AttributeError, match=r"no attribute 'Lion'; optimizers from installed plugins: \['AdamWMode'"
        ):
            optim.Lion  # noqa: B018
    finally:
        set_host(previous)


def test_two_plugins_offering_one_name_is_an_error_naming_both():
    class Other:
        @hookimpl
        def ortcore_register(self, register):
            register.optimizer("FusedAdam", object)

    host = PluginHost(Config.from_table({}, env={}), autoload=False, plugins={plugin.NAME: plugin, "other": Other()})
    with pytest.raises(
        Exception,
        match="plugins 'fused_adam' and 'other' both offer an optimizer 'FusedAdam'|plugins 'other' and 'fused_adam'",
    ):
        host.hooks.optimizers()


def test_disabled_plugin_is_named_in_the_import_error():
    host = PluginHost(Config.from_table({"plugins": {"disable": [plugin.NAME]}}, env={}))
    assert host.records[plugin.NAME].status == "disabled"
    assert "FusedAdam" not in optim.optimizers(host)
    previous = set_host(host)
    try:
        with pytest.raises(ImportError, match=r"provided by plugin 'fused_adam', which is disabled; enable it"):
            exec("from ortcore.optim import FusedAdam", {})
    finally:
        set_host(previous)


def test_importing_ortcore_optim_imports_no_torch():
    code = "import sys, ortcore, ortcore.optim; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_declared_names_are_read_without_importing():
    assert optim.declared_names("ortcore_plugins.fused_adam") == ("FusedAdam", "AdamWMode")
    assert optim.declared_names("ortcore_plugins.no_such_plugin") == ()
    assert importlib.import_module("ortcore.optim") is optim


# -- in ORTModule --------------------------------------------------------------------------------------------------


def test_ortmodule_training_with_fused_adam_matches_eager(ortcore_default_host):
    from ortcore import ORTModule

    model = mlp()
    eager = copy.deepcopy(model)
    ort = ORTModule(model)
    ort_losses = train(ort, FusedAdam(ort.parameters(), lr=1e-2, weight_decay=WD), mlp_loss, 20)
    eager_losses = train(eager, FusedAdam(eager.parameters(), lr=1e-2, weight_decay=WD), mlp_loss, 20)
    torch.testing.assert_close(ort_losses, eager_losses, rtol=1e-5, atol=0)
