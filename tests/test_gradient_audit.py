"""The gradient audit (``verify_gradients``): the first step of each new training graph is compared with PyTorch.

It passes silently on models whose gradients are right (MLP, CNN with batch norm, GPT-2 tiny, a model with active
dropout), finds a wrong gradient (ORT 1.19.2's ``Where`` gradient with a broadcast input, gradient_fixes off) or a
wrong forward (a graph pass that scales one ``Gemm``) and names the module, leaves the user's step exactly as it is
without the audit, runs once per built graph, and is switched on from ``ortcore.toml``, the environment or a keyword.
Each audit compares within rtol 1e-3 (of each tensor's largest value) / atol 1e-6, the defaults.
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Any

import models
import onnx
import pytest
import torch
from models import MLP, ConvNet, gpt2_batch, image_batch, tiny_gpt2
from onnxruntime.capi import _pybind_state as C
from torch import nn

from ortcore import GradientMismatchError, ORTModule
from ortcore.config import Config
from ortcore.errors import OptionError, StepCheckError
from ortcore.graph_passes import GraphPass
from ortcore.hooks import GlobalSubscriberManager, SubscriberBase
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginHost
from ortcore.testing import assert_matches_torch, make_host
from ortcore_plugins.doctor.checks import doctor
from ortcore_plugins.gradient_audit.audit import compare, node_module, random_nodes

NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


def _audited(model: nn.Module, host: Any = None, **kwargs: Any) -> ORTModule:
    return ORTModule(model, verify_gradients=True, fallback_policy="FALLBACK_DISABLE", host=host, **kwargs)


def _only_audit(wrapped: ORTModule) -> Any:
    assert len(wrapped.gradient_audits) == 1, wrapped.gradient_audits
    return wrapped.gradient_audits[0]


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


# -- passes on right gradients ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, batch",
    [
        (lambda: MLP(), lambda: (torch.randn(16, 12),)),
        (lambda: ConvNet(), lambda: (image_batch(torch.Generator().manual_seed(1))[0],)),
    ],
    ids=["mlp", "cnn-batchnorm"],
)
def test_audit_passes_silently_on_right_gradients(make, batch, caplog: pytest.LogCaptureFixture) -> None:
    wrapped = _audited(make())
    with caplog.at_level(logging.WARNING, logger="ortcore"):
        wrapped(*batch()).square().mean().backward()
    result = _only_audit(wrapped)
    assert result.status == "passed", result.message()
    assert result.graph == "the step's graph"
    assert result.compared >= 3 and result.worst.max_rel < 1e-4
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_audit_passes_on_gpt2_tiny(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("transformers")
    wrapped = _audited(tiny_gpt2())
    batch = gpt2_batch(torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger="ortcore"):
        out = wrapped(**batch, labels=batch["input_ids"])
        out.loss.backward()
    result = _only_audit(wrapped)
    assert result.status == "passed", result.message()
    # every output (loss, logits, the cache's keys and values), the audit's loss, every trained parameter
    outputs = wrapped.state_machine.current[0].output_schema.names
    assert len(outputs) == 6
    assert result.compared == len(outputs) + 1 + sum(1 for p in wrapped.parameters() if p.requires_grad)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_active_dropout_is_audited_with_dropout_off() -> None:
    wrapped = _audited(DropoutNet())
    wrapped(torch.randn(16, 12)).sum().backward()
    result = _only_audit(wrapped)
    assert result.status == "passed", result.message()
    assert result.graph == "the step's graph with dropout off"
    assert wrapped.module.drop.p == 0.3  # restored


def test_hf_bert_with_dropout_is_audited_with_dropout_off() -> None:
    """BERT's attention reads its dropout rate from an nn.Dropout module (``self.dropout.p``): switched off too."""
    pytest.importorskip("transformers")
    model = models.tiny_bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    rates = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    assert 0.1 in rates
    wrapped = _audited(model)
    wrapped(**models.bert_batch(torch.Generator().manual_seed(3))).loss.backward()
    result = _only_audit(wrapped)
    assert result.status == "passed", result.message()
    assert result.graph == "the step's graph with dropout off"
    assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == rates  # restored


class FunctionalNoise(nn.Module):
    """Random numbers outside any nn.Dropout module: nothing the audit can make deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.fc(x), p=0.5, training=True)


def test_random_ops_outside_dropout_modules_are_not_audited(caplog: pytest.LogCaptureFixture) -> None:
    wrapped = _audited(FunctionalNoise())
    with caplog.at_level(logging.WARNING, logger="ortcore"):
        wrapped(torch.randn(16, 12)).sum().backward()
    result = _only_audit(wrapped)
    assert result.status == "not audited"
    assert "Dropout" in result.reason and "outside torch.nn.Dropout modules" in result.reason
    assert any("not audited" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_random_nodes_ignore_zero_rate_and_inference_dropout() -> None:
    def graph(ratio: float | None, training: bool | None) -> onnx.ModelProto:
        nodes, inputs = [], ["x"]
        for name, value, dtype in (("ratio", ratio, onnx.TensorProto.FLOAT), ("mode", training, onnx.TensorProto.BOOL)):
            if value is None:
                inputs.append("")
                continue
            nodes.append(
                onnx.helper.make_node("Constant", [], [name], value=onnx.helper.make_tensor(name, dtype, [], [value]))
            )
            inputs.append(name)
        nodes.append(onnx.helper.make_node("Dropout", inputs, ["y"], name="/module/drop/Dropout"))
        return onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [], []))

    assert len(random_nodes(graph(0.1, True))) == 1
    assert len(random_nodes(graph(None, True))) == 1  # the default rate is 0.5
    assert random_nodes(graph(0.0, True)) == []
    assert random_nodes(graph(0.1, False)) == []
    assert random_nodes(graph(0.1, None)) == []  # no training_mode: inference


# -- finds wrong gradients and names the module ----------------------------------------------------------------------


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, 16))

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.tanh(self.w), h)  # w broadcast against x


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.gate = Gate()
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gate(self.a(x), x))


def _builtins_without(*names: str, extra: dict[str, Any] | None = None) -> Any:
    """A host of every built-in plugin but ``names``: gradient_fixes is essential (no user can disable it), so a
    test that shows what it fixes composes a host without it, as a test kit may."""
    return make_host({**models.builtin_plugins(names), **(extra or {})}, audit="gradient_audit" not in names)


def test_gradient_fixes_cannot_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTCORE_DISABLE_PLUGINS", "gradient_fixes")
    with pytest.raises(OptionError, match=r"plugin 'gradient_fixes' .* cannot be disabled: it is essential"):
        ORTModule(GatedNet(), host=PluginHost(Config.load()))


def test_wrong_where_gradient_without_gradient_fixes_names_the_module() -> None:
    # region_routing off too: nothing can repair the mismatch, so it reaches the user.
    wrapped = _audited(GatedNet(), host=_builtins_without("gradient_fixes", "region_routing"))
    x = torch.randn(8, 16)
    # The first step, audited as it runs, takes PyTorch's gradients (ORT's gradient of gate.w has the wrong shape);
    # the next call is audited by a step of its own, which names the module.
    wrapped(x).sum().backward()
    with pytest.raises(GradientMismatchError) as caught:
        wrapped(x).sum().backward()
    result = caught.value.result
    assert result.status == "mismatch"
    assert result.location.module == "gate" and result.location.module_type == "Gate"
    assert result.location.difference.name == "gate.w"
    assert "Where" in result.location.ort_ops
    message = str(caught.value)
    assert "module 'gate' (Gate)" in message and "gate.w" in message and "gradient_fixes" in message
    with pytest.raises(GradientMismatchError):  # a graph that failed its audit fails every step
        wrapped(x)
    assert len(wrapped.gradient_audits) == 1


def test_wrong_where_gradient_is_repaired_by_running_the_named_module_in_pytorch() -> None:
    model = GatedNet()
    reference = copy.deepcopy(model)
    wrapped = _audited(model, host=_builtins_without("gradient_fixes"))
    x = torch.randn(8, 16)
    for step in range(2):  # the first step takes PyTorch's gradients, the second is audited by a step of its own
        wrapped(x).sum().backward()
        reference(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert [r.region for r in wrapped.repairs] == ([] if step == 0 else ["gate"])
    first, second = wrapped.gradient_audits
    assert first.status == "mismatch" and first.location.module == "gate" and second.status == "passed"


def test_the_same_model_passes_with_gradient_fixes() -> None:
    wrapped = _audited(GatedNet())
    wrapped(torch.randn(8, 16)).sum().backward()
    assert _only_audit(wrapped).status == "passed"


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(16))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.s


class Head(nn.Module):
    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, h * 2.0, 0.0)  # h [1, 16] broadcast against x [8, 16]


class TwoPart(nn.Module):
    """The first wrong gradient is that of an activation (body's output), computed by the backward of ``head``; it
    reaches the input ``z`` with the wrong shape (the parameter's gradient is reduced right)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.head = Head()

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(z), x)


def test_wrong_activation_gradient_names_the_module_whose_backward_computes_it() -> None:
    host = make_host({}, env=NO_FALLBACK)  # no plugin: no gradient_fixes
    model = TwoPart()
    wrapped = _audited(copy.deepcopy(model), host=host)
    z, x = torch.randn(1, 16, requires_grad=True), torch.randn(8, 16)
    # The first step, audited as it runs, takes PyTorch's gradients (ORT's gradient of z has the wrong shape); the
    # next call is audited by a step of its own, which names the module.
    wrapped(z, x).sum().backward()
    expected = z.detach().clone().requires_grad_()
    model(expected, x).sum().backward()
    torch.testing.assert_close(z.grad, expected.grad)
    for p, q in zip(wrapped.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(GradientMismatchError) as caught:
        wrapped(z, x)
    assert {d.name for d in caught.value.result.differences} == {"z"}  # the input's gradient: wrong shape
    location = caught.value.result.location
    assert location.module == "head", caught.value
    assert location.difference.kind == "gradient of the output of module"
    assert location.difference.name == "body"
    assert "Where" in location.ort_ops
    host.close()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(h))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.block = Block()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.embed(x)))


def _scale_block_fc(model: onnx.ModelProto, context: Any) -> None:
    """A deliberately wrong graph: block.fc's Gemm output times 1.01."""
    nodes = list(model.graph.node)
    index, node = next((i, n) for i, n in enumerate(nodes) if n.op_type == "Gemm" and "/block/fc/" in n.name)
    out = node.output[0]
    node.output[0] = out + "_unscaled"
    scale = onnx.helper.make_node(
        "Constant", [], [out + "_scale"], value=onnx.helper.make_tensor("s", onnx.TensorProto.FLOAT, [], [1.01])
    )
    mul = onnx.helper.make_node("Mul", [out + "_unscaled", out + "_scale"], [out], name="/module/block/fc/scaled")
    del model.graph.node[:]
    model.graph.node.extend([*nodes[: index + 1], scale, mul, *nodes[index + 1 :]])


def test_wrong_forward_names_the_first_module_whose_output_differs() -> None:
    plugin = types.SimpleNamespace(
        ortcore_graph_passes=hookimpl(lambda: [GraphPass("scale_block_fc", run=_scale_block_fc)])
    )
    host = make_host({"scaler": plugin}, env=NO_FALLBACK)
    wrapped = _audited(Stack(), host=host)
    with pytest.raises(GradientMismatchError) as caught:
        wrapped(torch.randn(5, 4))
    result = caught.value.result
    assert result.location.module == "block.fc"
    assert result.location.difference.kind == "output of module"
    assert result.location.difference.max_rel == pytest.approx(0.01, rel=0.05)
    assert {d.kind for d in result.differences} >= {"output", "loss", "gradient of parameter"}
    assert set(result.location.ort_ops) == {"Gemm", "Mul"}
    host.close()


# -- the user's step is untouched ------------------------------------------------------------------------------------


class Recorder(SubscriberBase):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def on_step_start(self, step: int) -> None:
        self.events.append(("start", step))

    def on_forward(self, step: int, order: int, name: str, tensor: torch.Tensor) -> None:
        self.events.append(("forward", step, order, name, tensor.clone()))

    def on_backward(self, step: int, order: int, name: str, grad: torch.Tensor) -> None:
        self.events.append(("backward", step, order, name, grad.clone()))


def _user_steps(model: nn.Module, verify: bool, subscribe: bool) -> dict[str, Any]:
    torch.manual_seed(7)
    C.set_seed(7)  # ORT's own generator (its Dropout kernels)
    wrapped = ORTModule(model, verify_gradients=verify, fallback_policy="FALLBACK_DISABLE")
    recorder = Recorder()
    if subscribe:
        GlobalSubscriberManager.subscribe(wrapped, [recorder])
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    outputs = []
    for _ in range(3):
        x = torch.randn(16, 12)
        out = wrapped(x)
        out.square().mean().backward()
        outputs.append(out.detach().clone())
        optimizer.step()
        optimizer.zero_grad()
    final = wrapped(torch.randn(16, 12))
    final.sum().backward()
    if subscribe:
        GlobalSubscriberManager.unsubscribe(wrapped)
    return {
        "outputs": outputs + [final.detach()],
        "grads": {n: p.grad.clone() for n, p in wrapped.named_parameters()},
        "state": {n: t.clone() for n, t in wrapped.state_dict().items()},
        "rng": torch.rand(4),
        "events": recorder.events,
        "audits": [r.status for r in wrapped.gradient_audits],
    }


@pytest.mark.parametrize(
    "make",
    [DropoutNet, lambda: nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))],
    ids=["dropout", "batchnorm"],
)
def test_user_step_is_identical_with_and_without_the_audit(make) -> None:
    torch.manual_seed(0)
    model = make()
    plain = _user_steps(copy.deepcopy(model), verify=False, subscribe=True)
    audited = _user_steps(copy.deepcopy(model), verify=True, subscribe=True)
    assert audited["audits"] == ["passed"] and plain["audits"] == []
    for a, b in zip(audited["outputs"], plain["outputs"]):
        assert torch.equal(a, b)
    for name in plain["grads"]:
        assert torch.equal(audited["grads"][name], plain["grads"][name]), name
    for name in plain["state"]:  # parameters after AdamW, batch-norm statistics
        assert torch.equal(audited["state"][name], plain["state"][name]), name
    assert torch.equal(audited["rng"], plain["rng"])  # torch's RNG stream
    # the subscribers saw the same steps, activations and gradients
    assert [e[:4] for e in audited["events"]] == [e[:4] for e in plain["events"]]
    for a, b in zip(audited["events"], plain["events"]):
        if len(a) == 5:
            assert torch.equal(a[4], b[4])


def test_audit_runs_once_per_built_graph() -> None:
    model = MLP()
    wrapped = _audited(model)
    wrapped(torch.randn(16, 12)).sum().backward()
    wrapped(torch.randn(16, 12)).sum().backward()  # the same graph: not audited again
    assert len(wrapped.gradient_audits) == 1
    with torch.no_grad():
        wrapped(torch.randn(3, 12))  # an inference graph: nothing to audit
    assert len(wrapped.gradient_audits) == 1
    model.fc1.weight.requires_grad_(False)  # a new build
    wrapped(torch.randn(16, 12)).sum().backward()
    assert [r.status for r in wrapped.gradient_audits] == ["passed", "passed"]
    assert wrapped.state_machine.counters.builds == 3
    model.fc1.weight.requires_grad_(True)  # the first build again, from the cache: already audited
    wrapped(torch.randn(16, 12)).sum().backward()
    assert len(wrapped.gradient_audits) == 2


def test_audit_is_on_by_default_and_off_by_option(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapped = ORTModule(MLP())
    wrapped(torch.randn(16, 12)).sum().backward()
    assert wrapped.runtime_options.verify_gradients is True
    assert [a.status for a in wrapped.gradient_audits] == ["passed"]
    monkeypatch.setenv("ORTCORE_VERIFY_GRADIENTS", "0")
    off = ORTModule(MLP())
    off(torch.randn(16, 12)).sum().backward()
    assert off.gradient_audits == []


# -- the option ------------------------------------------------------------------------------------------------------


def test_option_from_toml_env_and_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = Config.from_table({"verify_gradients": True, "verify_gradients_rtol": 1e-2}, env={})
    assert from_file.core.verify_gradients is True and from_file.core.verify_gradients_rtol == 1e-2
    from_env = Config.from_table({}, env={"ORTCORE_VERIFY_GRADIENTS": "1"})
    assert from_env.core.verify_gradients is True and from_env.sources["core.verify_gradients"].startswith("env")
    # the keyword is above the file, below the environment
    keyword = Config.from_table({"verify_gradients": False}, env={}).with_code_options(None, verify_gradients=True)
    assert keyword.core.verify_gradients is True and keyword.sources["core.verify_gradients"] == "argument"
    env_wins = Config.from_table({}, env={"ORTCORE_VERIFY_GRADIENTS": "0"}).with_code_options(
        None, verify_gradients=True
    )
    assert env_wins.core.verify_gradients is False
    monkeypatch.setenv("ORTCORE_VERIFY_GRADIENTS", "yes")
    wrapped = ORTModule(MLP())
    assert wrapped.runtime_options.verify_gradients is True
    wrapped(torch.randn(4, 12)).sum().backward()
    assert _only_audit(wrapped).status == "passed"


@pytest.mark.parametrize(
    "table, env, named",
    [
        ({"verify_gradients": "maybe"}, {}, "verify_gradients='maybe'"),
        ({}, {"ORTCORE_VERIFY_GRADIENTS": "sometimes"}, "ORTCORE_VERIFY_GRADIENTS='sometimes'"),
        ({"verify_gradients_rtol": -1}, {}, "verify_gradients_rtol=-1"),
        ({"verify_gradients_atol": "tiny"}, {}, "verify_gradients_atol='tiny'"),
    ],
)
def test_bad_option_value_is_named(table: dict, env: dict, named: str) -> None:
    with pytest.raises(OptionError, match=named.replace("(", r"\(")):
        Config.from_table(table, env=env)


def test_bad_keyword_value_is_named() -> None:
    with pytest.raises(OptionError, match="verify_gradients='often'"):
        ORTModule(MLP(), verify_gradients="often")


def test_doctor_recommends_the_audit() -> None:
    findings = doctor(None, env={"GOMP_SPINCOUNT": "10000"})
    assert any("verify_gradients" in f.what + f.fix for f in findings)


@pytest.mark.parametrize("env", [{}, {"ORTCORE_VERIFY_GRADIENTS": "0"}])
def test_doctor_never_says_ok_with_a_fix(env) -> None:
    """A check that suggests a fix found something to fix: "ok" followed by "fix:" contradicts itself."""
    host = make_host({}, env=env)
    try:
        findings = doctor(host, env={"GOMP_SPINCOUNT": "10000", **env})
    finally:
        host.close()
    assert [f for f in findings if f.level == "ok" and f.fix] == []
    [audit] = [f for f in findings if f.what.startswith("gradient audit")]
    if env:
        assert audit.level == "warning" and "verify_gradients" in audit.fix
    else:
        assert audit.level == "ok" and not audit.fix


def test_a_doctor_finding_that_is_ok_cannot_carry_a_fix() -> None:
    from ortcore_plugins.doctor.checks import Finding

    with pytest.raises(ValueError, match="an 'ok' finding suggests no fix"):
        Finding("ok", "all good", "but do this")


# -- helpers ---------------------------------------------------------------------------------------------------------


def test_compare_treats_a_missing_gradient_as_zeros_and_scales_by_the_largest_value() -> None:
    zeros = torch.zeros(3)
    assert not compare("gradient of parameter", "w", None, zeros, 1e-3, 1e-6).exceeds
    assert compare("gradient of parameter", "w", None, torch.ones(3), 1e-3, 1e-6).exceeds
    big = torch.tensor([1000.0, 1e-3])
    assert not compare("output", "y", big + torch.tensor([0.5, 0.5]), big, 1e-3, 1e-6).exceeds
    assert compare("output", "y", big + torch.tensor([2.0, 0.0]), big, 1e-3, 1e-6).exceeds
    nan = torch.tensor([float("nan"), 1.0])
    assert not compare("output", "y", nan.clone(), nan, 1e-3, 1e-6).exceeds
    assert compare("output", "y", torch.tensor([0.0, 1.0]), nan, 1e-3, 1e-6).exceeds


def test_node_module_reads_the_exporters_scopes() -> None:
    paths = {"", "0", "encoder", "encoder.layer", "encoder.layer.0", "encoder.layer.0.attention"}
    assert node_module("/module/encoder/layer.0/attention/MatMul", paths) == "encoder.layer.0.attention"
    assert node_module("/module/module.0/Gemm", paths) == "0"  # a Sequential's numbered child
    assert node_module("/module/Mul", paths) == ""
    assert node_module("ortcore.gradient_fixes//module/encoder/Where/Shape_of_/module/x", paths) == "encoder"
    assert node_module("Gemm_12", paths) is None


def test_models_helper_is_unchanged_by_the_audit() -> None:
    """The audit's PyTorch run uses aliases: a model trained with the audit equals one trained in PyTorch."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    wrapped = _audited(model)
    x = torch.randn(16, 12)
    wrapped(x).square().mean().backward()
    reference(x).square().mean().backward()
    models.assert_grads_match(wrapped, reference)


# -- the hook the audit implements: ortcore_check_first_step ---------------------------------------------------------


class _Checker:
    """A first-step check of its own: records each step it sees; fails a graph holding ``block``'s Gemm."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.fail_on = fail_on
        self.seen: list[Any] = []

    @hookimpl
    def ortcore_check_first_step(self, config: Config, step: Any) -> Any:
        self.seen.append(step)
        names = [n.name for n in step.graph.model.graph.node if n.op_type == "Gemm"]
        if self.fail_on and any(f"/{self.fail_on}/" in name for name in names):
            raise StepCheckError(
                f"{self.fail_on} computes in ORT", result=("failed", self.fail_on), module=self.fail_on
            )
        assert step.trainable and step.tensors and set(step.params) >= set(step.trainable)
        return ("checked", len(step.graph.model.graph.node))


def test_hook_ortcore_check_first_step_runs_once_per_session_and_its_reports_are_listed() -> None:
    checker = _Checker()
    host = make_host({"checker": checker}, audit=False)
    model = MLP()
    reference = copy.deepcopy(model)
    wrapped = _audited(model, host=host)
    for _ in range(3):
        x = torch.randn(16, 12)
        wrapped(x).square().mean().backward()
        reference(x).square().mean().backward()
    assert len(checker.seen) == 1 and wrapped.state_machine.counters.audits == 1
    assert wrapped.gradient_audits == [("checked", len(checker.seen[0].graph.model.graph.node))]
    for p, q in zip(wrapped.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)  # the check changed nothing
    host.close()


def test_hook_ortcore_check_first_step_is_not_asked_with_verify_gradients_off() -> None:
    checker = _Checker(fail_on="embed")
    host = make_host({"checker": checker}, audit=False)
    wrapped = ORTModule(Stack(), verify_gradients=False, host=host)
    wrapped(torch.randn(5, 4)).sum().backward()
    assert checker.seen == [] and wrapped.gradient_audits == []
    host.close()


def test_a_failed_first_step_check_is_repaired_by_routing_the_module_it_names() -> None:
    """The contract with the repair loop: StepCheckError(module=...) routes that module to PyTorch, and the new
    session is checked again (and passes); the trained result is PyTorch's."""
    checker = _Checker(fail_on="block")
    host = _builtins_without("gradient_audit", extra={"checker": checker})
    model = Stack()
    wrapped = assert_matches_torch(model, (torch.randn(5, 4),), host=host, verify_gradients=True)
    assert len(checker.seen) == 2, "the repaired session is checked again"
    assert [r.region for r in wrapped.repairs] == ["block"]
    assert wrapped.gradient_audits == [("failed", "block"), ("checked", len(checker.seen[1].graph.model.graph.node))]
    host.close()


def test_a_session_that_failed_its_check_fails_every_step() -> None:
    checker = _Checker(fail_on="block")
    host = make_host({"checker": checker}, env=NO_FALLBACK, audit=False)  # no routing plugin: nothing repairs it
    wrapped = _audited(Stack(), host=host)
    for _ in range(2):
        with pytest.raises(StepCheckError, match="block computes in ORT"):
            wrapped(torch.randn(5, 4))
    assert len(checker.seen) == 1
    host.close()


def test_verify_gradients_without_any_checking_plugin_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    host = make_host({}, audit=False)
    wrapped = _audited(MLP(), host=host)
    with caplog.at_level(logging.WARNING, logger="ortcore"):
        for _ in range(2):
            wrapped(torch.randn(16, 12)).sum().backward()
    said = [r.getMessage() for r in caplog.records if "no enabled plugin checks first steps" in r.getMessage()]
    assert len(said) == 1 and wrapped.gradient_audits == []
    host.close()
