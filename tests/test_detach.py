"""``detach()`` in a model run by ortcore: constants, stop-gradients inside a gradient path, detached outputs.

Every model is compared with the same model run in PyTorch (outputs, loss, every parameter's gradient including
which ones are None, a 3-step AdamW loss curve) at float32 tolerances rtol 1e-5 / atol 1e-6. The decisions of
:func:`ortcore_plugins.gradient_fixes.plan_stop_gradients` (Identity or a real stop-gradient) are checked on small
hand-made graphs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from models import assert_curves_match, assert_grads_match, assert_ran_in_ort, ort_and_torch, train_curve
from onnx import TensorProto, helper
from torch import nn

from ortcore import ORTModule, UnsupportedModelError
from ortcore.api import GraphBuildError, StopGradientLowering, hookimpl
from ortcore.domains import STOP_GRADIENT, STOP_GRADIENT_DOMAIN
from ortcore.graph import StopGradientPlan, value_dependencies
from ortcore.testing import assert_matches_torch, make_host
from ortcore_plugins.gradient_fixes import plan_stop_gradients, resolve_stop_gradients

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_parity(
    model: nn.Module,
    make_input: Callable[[torch.Generator], torch.Tensor],
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    *,
    input_requires_grad: bool = False,
) -> tuple[ORTModule, nn.Module]:
    """Loss, every gradient (parameters and, if it requires grad, the input) and a 3-step AdamW curve match torch."""
    ort, ref = ort_and_torch(model)
    gen = torch.Generator().manual_seed(7)
    x = make_input(gen)
    x_ort, x_ref = x.clone().requires_grad_(input_requires_grad), x.clone().requires_grad_(input_requires_grad)
    loss, loss_ref = loss_fn(ort, x_ort), loss_fn(ref, x_ref)
    assert_close(loss, loss_ref, "loss")
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref, rtol=RTOL, atol=ATOL)
    if input_requires_grad:
        assert (x_ort.grad is None) == (x_ref.grad is None), "input gradient: one side has none"
        if x_ref.grad is not None:
            assert_close(x_ort.grad, x_ref.grad, "input gradient")
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    batches = [make_input(gen) for _ in range(STEPS)]
    assert_curves_match(train_curve(ort, batches, loss_fn), train_curve(ref, batches, loss_fn), rtol=RTOL)
    assert_grads_match(ort, ref, rtol=RTOL, atol=ATOL)  # the last step's gradients too
    assert_ran_in_ort(ort, exports=1)
    return ort, ref


def features(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(6, 4, generator=gen)


def summed(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


# -- 1. a detached constant -------------------------------------------------------------------------------------------


class ScaledByConstant(nn.Module):
    """DeBERTa's scaling: ``torch.tensor(h.size(-1))`` is traced as a shape followed by detaches."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(torch.tanh(h / torch.sqrt(torch.tensor(h.size(-1), dtype=torch.float))))


def test_detached_constant_in_a_gradient_path_matches_torch():
    check_parity(ScaledByConstant(), features, summed)


# -- 2. a stop-gradient inside the gradient path ---------------------------------------------------------------------


class TimesItsDetachedSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * y.detach()


def test_y_times_detached_y_has_gradient_y_not_2y():
    ort, ref = check_parity(TimesItsDetachedSelf(), features, summed)
    # What the parity means here: d(y * stop(y))/dy = y, which is half of d(y*y)/dy.
    x = features(torch.Generator().manual_seed(3))
    ort.zero_grad(set_to_none=True)
    ort(x).sum().backward()
    assert_close(ort.fc.bias.grad, ort.fc(x).detach().sum(0), "bias gradient (sum of y over the batch)")


# -- 3. a detached input -----------------------------------------------------------------------------------------------


class DetachedInputBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.detach()) * x * self.w


def test_detached_input_gets_no_gradient_through_that_branch():
    check_parity(DetachedInputBranch(), features, summed, input_requires_grad=True)


# -- 4. a parameter used detached and not ------------------------------------------------------------------------------


class ParameterUsedDetachedAndNot(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w.detach() * self.a(x) + self.w * self.b(x)) ** 2


def test_parameter_used_both_detached_and_not_matches_torch():
    check_parity(ParameterUsedDetachedAndNot(), features, summed)


# -- 5. whole branches detached: torch gives their parameters no gradient ---------------------------------------------


class DetachedBranchOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), torch.tanh(self.b(x)).detach() * 3


def test_output_computed_only_from_a_detached_branch_leaves_its_parameters_without_gradient():
    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out, detached = model(x)
        assert not detached.requires_grad
        return out.sum() + detached.sum()

    ort, ref = check_parity(DetachedBranchOutput(), features, loss_fn)
    assert ref.b.weight.grad is None and ort.b.weight.grad is None and ort.b.bias.grad is None


class OnlyDetached(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)).detach() * 2


def test_model_whose_only_output_is_detached_returns_a_tensor_without_grad():
    ort, ref = ort_and_torch(OnlyDetached())
    x = features(torch.Generator().manual_seed(1))
    out, expected = ort(x), ref(x)
    assert_close(out, expected, "output")
    assert out.requires_grad is expected.requires_grad is False
    assert all(p.grad is None for p in ort.parameters())
    assert_ran_in_ort(ort)


class FrozenTeacher(nn.Module):
    """Distillation: the teacher's output is a detached target, so its parameters get no gradient in torch."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((self.student(x) - torch.tanh(self.teacher(x)).detach()) ** 2).mean()


def test_detached_teacher_gets_none_not_zeros_and_student_matches_torch():
    ort, ref = check_parity(FrozenTeacher(), features, lambda m, x: m(x))
    assert ref.teacher.weight.grad is None and ort.teacher.weight.grad is None
    # weight decay would move a parameter whose gradient were zeros: AdamW skips it only for None
    assert_close(ort.teacher.weight, ref.teacher.weight, "teacher weight after training")


class HardRouter(nn.Module):
    """A hard choice (VQ codebooks, top-1 routers): the router's weight reaches the loss only through ``argmax``,
    which has no gradient. torch gives it None; ORT's builder refuses a name it cannot reach from the outputs."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 5)
        self.codes = nn.Embedding(5, 3)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.codes(self.router(x).argmax(-1)) * self.head(x)


def test_parameter_reaching_the_loss_only_through_argmax_gets_none_as_in_torch():
    ort, ref = check_parity(HardRouter(), features, summed)
    assert ref.router.weight.grad is None and ort.router.weight.grad is None
    assert_close(ort.router.weight, ref.router.weight, "router weight after training (AdamW skips a None gradient)")


# -- 6. DeBERTa-v2 ----------------------------------------------------------------------------------------------------


def tiny_deberta() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.DebertaV2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.DebertaV2ForMaskedLM(config)


def test_deberta_v2_masked_lm_trains_in_ort_like_torch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    ort, ref = ort_and_torch(tiny_deberta())
    gen = torch.Generator().manual_seed(11)
    batches = [
        {
            "input_ids": torch.randint(0, 100, (2, 12), generator=gen),
            "attention_mask": torch.ones(2, 12, dtype=torch.long),
            "labels": torch.randint(0, 100, (2, 12), generator=gen),
        }
        for _ in range(STEPS + 1)
    ]
    out, expected = ort(**batches[0]), ref(**batches[0])
    assert_close(out.logits, expected.logits, "logits")
    assert_close(out.loss, expected.loss, "loss")
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(ort, ref, rtol=RTOL, atol=ATOL)
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    assert_curves_match(train_curve(ort, batches[1:], loss_fn), train_curve(ref, batches[1:], loss_fn), rtol=RTOL)
    assert_ran_in_ort(ort, exports=1)


# -- 7. no grad and eval ------------------------------------------------------------------------------------------------


class ConstantAndStopGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) / torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float))
        return y * y.detach()


def test_detach_under_no_grad_and_in_eval_matches_torch():
    ort, ref = ort_and_torch(ConstantAndStopGradient())
    x = features(torch.Generator().manual_seed(5))
    with torch.no_grad():
        out, expected = ort(x), ref(x)
    assert_close(out, expected, "output under no_grad")
    assert not out.requires_grad
    ort.eval()
    ref.eval()
    with torch.no_grad():
        assert_close(ort(x), ref(x), "eval output under no_grad")
    out, expected = ort(x), ref(x)  # eval with grad enabled: a training graph of the eval-mode model
    assert_close(out, expected, "eval output")
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(ort, ref, rtol=RTOL, atol=ATOL)
    assert_ran_in_ort(ort)


# -- what a real stop-gradient needs ------------------------------------------------------------------------------------


class SharedTrunkTeacher(nn.Module):
    """The teacher reads the trunk the student trains: its parameters reach the loss only through a detach whose
    upstream (the trunk) needs a gradient."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return ((self.student(h) - self.teacher(h).detach()) ** 2).mean()


def test_parameters_behind_a_stop_gradient_with_trained_upstream_get_no_gradient():
    ort, _ = check_parity(SharedTrunkTeacher(), features, lambda m, x: m(x))
    assert ort.teacher.weight.grad is None and ort.teacher.bias.grad is None
    assert ort.state_machine.counters.fallbacks == 0


_WITHOUT_EXECUTOR = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_detach import ScaledByConstant, TimesItsDetachedSelf
    from models import ort_and_torch, assert_grads_match, wrap
    from ortcore import UnsupportedModelError
    x = torch.randn(6, 4)
    ort, ref = ort_and_torch(ScaledByConstant())
    ort(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_match(ort, ref, rtol=1e-5, atol=1e-6)
    try:
        wrap(TimesItsDetachedSelf())(x)
    except UnsupportedModelError as e:
        print("REFUSED:", e)
    """
)


@pytest.mark.slow
def test_without_an_aten_executor_a_stop_gradient_is_refused_naming_the_plugin_and_constants_still_train():
    # A fresh process: the ATen executor, once registered, stays for the life of the process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    env["ORTCORE_DISABLE_PLUGINS"] = "aten_fallback,op_routing,efficient_attention"  # each registers the executor
    script = _WITHOUT_EXECUTOR.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED:" in result.stdout, result.stdout + result.stderr[-3000:]
    message = result.stdout.split("REFUSED:", 1)[1]
    assert "detach() in the model's own forward" in message, message
    assert "no ATen executor is registered" in message and "enable the aten_fallback plugin" in message, message


# -- the plan, on hand-made graphs ----------------------------------------------------------------------------------------


def _graph(nodes: list[onnx.NodeProto], inputs: list[tuple[str, int]], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, dtype, None) for name, dtype in inputs],
        [helper.make_empty_tensor_value_info(name) for name in outputs],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(STOP_GRADIENT_DOMAIN, 1)]
    )


def _detach(x: str, y: str) -> onnx.NodeProto:
    return helper.make_node(STOP_GRADIENT, [x], [y], domain=STOP_GRADIENT_DOMAIN, name=f"/module/{y}")


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_plan_makes_a_detached_shape_an_identity():
    model = _graph(
        [
            helper.make_node("Shape", ["w"], ["s"]),
            helper.make_node("Cast", ["s"], ["f"], to=TensorProto.FLOAT),
            _detach("f", "d"),
            helper.make_node("Mul", ["w", "d"], ["y"]),
        ],
        [("w", TensorProto.FLOAT)],
        ["y"],
    )
    plan = plan_stop_gradients(model, ["w"], build_gradient=True)
    assert plan.real_stop_gradients == 0 and "StopGradient" not in _ops(plan.model)
    assert plan.train_names == ["w"] and plan.no_grad_outputs == set()
    assert all(o.domain != STOP_GRADIENT_DOMAIN for o in plan.model.opset_import)


def test_plan_makes_a_stop_gradient_in_a_gradient_path_an_aten_detach_reading_a_copy_of_an_input():
    model = _graph([_detach("w", "d"), helper.make_node("Mul", ["w", "d"], ["y"])], [("w", TensorProto.FLOAT)], ["y"])
    plan = plan_stop_gradients(model, ["w"], build_gradient=True)
    assert plan.real_stop_gradients == 1
    assert _ops(plan.model) == ["Identity", "ATen", "Mul"]  # the copy first: ORT's builder would count the ATen
    aten = plan.model.graph.node[1]
    assert {a.name: helper.get_attribute_value(a) for a in aten.attribute} == {
        "operator": b"detach_copy",
        "overload_name": b"default",
    }
    assert aten.input[0] == plan.model.graph.node[0].output[0]


def test_plan_without_gradient_makes_every_detach_an_identity():
    model = _graph([_detach("w", "d"), helper.make_node("Mul", ["w", "d"], ["y"])], [("w", TensorProto.FLOAT)], ["y"])
    plan = plan_stop_gradients(model, ["w"], build_gradient=False)
    assert _ops(plan.model) == ["Identity", "Mul"] and plan.no_grad_outputs == {"y"}


def test_plan_leaves_out_names_reached_only_through_a_real_stop_gradient():
    model = _graph(
        [
            helper.make_node("Mul", ["x", "t"], ["h"]),
            _detach("h", "d"),
            helper.make_node("Sub", ["x", "d"], ["y"]),
        ],
        [("x", TensorProto.FLOAT), ("t", TensorProto.FLOAT)],
        ["y"],
    )
    plan = plan_stop_gradients(model, ["x", "t"], build_gradient=True)
    assert plan.real_stop_gradients == 1 and plan.train_names == ["x"]
    with pytest.raises(UnsupportedModelError, match="t reach the outputs only through a detach"):
        resolve_stop_gradients(model, ["x", "t"], build_gradient=True)


def test_value_dependencies_stop_at_detaches_and_index_inputs():
    model = _graph(
        [
            _detach("a", "d"),
            helper.make_node("Shape", ["b"], ["s"]),
            helper.make_node("Reshape", ["c", "s"], ["r"]),
            helper.make_node("Add", ["d", "r"], ["y"]),
        ],
        [("a", TensorProto.FLOAT), ("b", TensorProto.FLOAT), ("c", TensorProto.FLOAT)],
        ["y"],
    )
    assert value_dependencies(model, ["y"]) == {"y": {"c"}}


# -- the hook: ortcore_lower_stop_gradients ---------------------------------------------------------------------------

NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


class PlanObserver:
    """Sees what was decided, after every other implementation."""

    def __init__(self):
        self.seen: list[tuple[int, StopGradientPlan]] = []

    @hookimpl(trylast=True)
    def ortcore_lower_stop_gradients(self, lowering: StopGradientLowering) -> None:
        self.seen.append((len(lowering.markers), lowering.plan))


class MarkersAsIdentities:
    """Lowers every marker to an Identity, its own way (exact for a detached constant, not in general)."""

    def __init__(self):
        self.plans: list[StopGradientPlan] = []

    @hookimpl(tryfirst=True)
    def ortcore_lower_stop_gradients(self, lowering: StopGradientLowering) -> None:
        model = onnx.ModelProto.FromString(lowering.forward.SerializeToString())
        for node in model.graph.node:
            if node.domain == STOP_GRADIENT_DOMAIN:
                node.op_type, node.domain = "Identity", ""
        kept = [o for o in model.opset_import if o.domain != STOP_GRADIENT_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
        lowering.decide(model, list(lowering.train_names))
        self.plans.append(lowering.plan)


def test_hook_lower_stop_gradients_on_a_bare_host_is_gradient_fixes_lowering_which_a_plugin_observes():
    observer = PlanObserver()
    host = make_host({"observer": observer}, env=NO_FALLBACK)
    assert host.records["gradient_fixes.stop_gradients"].enabled and "gradient_fixes" not in host.records
    assert_matches_torch(ScaledByConstant(), (features(torch.Generator().manual_seed(1)),), host=host)
    assert observer.seen and all(markers > 0 and plan.real_stop_gradients == 0 for markers, plan in observer.seen)
    assert all(plan.train_names and "StopGradient" not in _ops(plan.model) for _, plan in observer.seen)
    host.close()


def test_hook_lower_stop_gradients_answered_first_by_another_plugin_is_left_to_it():
    own, observer = MarkersAsIdentities(), PlanObserver()
    host = make_host({"own": own, "observer": observer}, env=NO_FALLBACK)
    assert_matches_torch(ScaledByConstant(), (features(torch.Generator().manual_seed(2)),), host=host)
    assert own.plans and [plan for _, plan in observer.seen] == own.plans  # gradient_fixes did not decide again
    host.close()


def test_a_host_composed_without_gradient_fixes_refuses_a_detach_naming_the_plugin():
    host = make_host({}, env={"ORTCORE_DISABLE_PLUGINS": "gradient_fixes", **NO_FALLBACK})
    assert host.records["gradient_fixes.stop_gradients"].status == "disabled"
    x = features(torch.Generator().manual_seed(3))
    with pytest.raises(GraphBuildError, match=r"detach\(\) marker.* no plugin lowered .* gradient_fixes"):
        ORTModule(ScaledByConstant(), host=host)(x)
    assert_matches_torch(nn.Linear(4, 3), (x,), host=host)  # a graph without markers needs no plugin
    host.close()
