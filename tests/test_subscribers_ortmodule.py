"""Activation subscribers on an ORTModule: the tensors come from ONNX Runtime's own run, and match PyTorch's.

Each test runs the same model twice from the same weights, once plain and once wrapped, both subscribed, and
compares what the subscribers received. Tolerances: forward values and gradients within rtol 1e-4, atol 1e-5 (the
core's parity tolerances); statistics compared by ``find_divergence`` at its defaults (rtol 1e-3, atol 1e-6).
"""

from __future__ import annotations

import copy
import json
import os
import types
from pathlib import Path

import onnx
import pytest
import torch

import ortcore_plugins.activation_stats as activation_stats
from ortcore import ORTModule
from ortcore.errors import PluginError
from ortcore.graph_passes import GraphPass
from ortcore.hooks import GlobalSubscriberManager, SubscriberBase
from ortcore.hookspecs import hookimpl
from ortcore.host import set_host
from ortcore.taps import recorder_of
from ortcore.testing import ACTIVATION_NET_NAMES, ActivationNet, make_host
from ortcore_plugins.activation_stats import find_divergence

RTOL, ATOL = 1e-4, 1e-5


class Recorder(SubscriberBase):
    """Keeps a copy of every tensor it receives, and the sequence of callbacks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.forward: dict[tuple[int, str], torch.Tensor] = {}
        self.backward: dict[tuple[int, str], torch.Tensor] = {}
        self.events: list[tuple] = []

    def on_step_start(self, step):
        self.events.append(("start", step, self.engine))

    def on_forward(self, step, order, name, tensor):
        self.forward[(step, name)] = tensor.clone()
        self.events.append(("forward", step, order, name))

    def on_backward(self, step, order, name, grad):
        self.backward[(step, name)] = grad.clone()
        self.events.append(("backward", step, order, name))

    def on_step_end(self, step):
        self.events.append(("end", step))


NAMES = ACTIVATION_NET_NAMES


@pytest.fixture
def host():
    """Only activation_stats installed; every subscription is removed afterwards."""
    host = make_host({"activation_stats": activation_stats})
    previous = set_host(host)
    yield host
    for subscription in list(GlobalSubscriberManager._subscriptions.values()):
        GlobalSubscriberManager.unsubscribe(subscription.model)
    set_host(previous)


def train(model, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def assert_same_tensors(expected: dict, got: dict, what: str):
    assert sorted(got) == sorted(expected), f"{what}: different activations"
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{what} {k}: {m}")


@pytest.mark.parametrize("when", ["before wrapping", "after wrapping"])
def test_ortmodule_delivers_what_torch_delivers(host, when):
    torch.manual_seed(0)
    plain = ActivationNet()
    model = copy.deepcopy(plain)
    expected, got = Recorder(), Recorder()
    GlobalSubscriberManager.subscribe(plain, [expected])
    if when == "before wrapping":
        GlobalSubscriberManager.subscribe(model, [got])
        wrapped = ORTModule(model, host=host)
    else:
        wrapped = ORTModule(model, host=host)
        GlobalSubscriberManager.subscribe(wrapped, [got])
    assert GlobalSubscriberManager.is_subscribed(wrapped) and GlobalSubscriberManager.is_subscribed(model)
    train(plain)
    train(wrapped)

    assert wrapped.state_machine.counters.fallbacks == 0, wrapped.fallback_reason
    assert {name for _, name in got.forward} == NAMES and {name for _, name in got.backward} == NAMES
    assert_same_tensors(expected.forward, got.forward, "forward")
    assert_same_tensors(expected.backward, got.backward, "gradient")
    # Same callbacks and numbering for the forward; ORT hands over the gradients after its backward, last first.
    assert [e for e in got.events if e[0] != "backward"] == [
        e if e[0] != "start" else (*e[:2], "ortcore") for e in expected.events if e[0] != "backward"
    ]
    for step in range(3):
        orders = [e[2] for e in got.events if e[0] in ("forward", "backward") and e[1] == step]
        assert orders == list(range(2 * len(NAMES)))


def test_steps_outside_the_window_run_the_graph_without_taps(host):
    model = ORTModule(ActivationNet(), host=host)
    recorder = Recorder(start_step=1, end_step=2)
    GlobalSubscriberManager.subscribe(model, [recorder])
    train(model, steps=4)
    assert {step for step, _ in recorder.forward} == {step for step, _ in recorder.backward} == {1}
    # Step 0 exports without taps, step 1 with them, steps 2-3 reuse the first graph.
    assert model.state_machine.counters.exports == 2 and model.state_machine.counters.reuses == 2
    (graph, session), *_ = [v for k, v in model.state_machine._sessions.items() if not k[0][-1]]
    assert not graph.taps and not any(o.name.startswith("ortcore.tap::") for o in session.model.graph.output)

    GlobalSubscriberManager.unsubscribe(model)
    train(model, steps=1)
    assert model.state_machine.counters.exports == 2  # unsubscribed: back to the graph without taps


def test_eval_and_no_grad_steps(host):
    torch.manual_seed(0)
    plain = ActivationNet()
    model = ORTModule(copy.deepcopy(plain), host=host)
    expected, got = Recorder(), Recorder()
    GlobalSubscriberManager.subscribe(plain, [expected])
    GlobalSubscriberManager.subscribe(model, [got])
    x = torch.randn(3, 4)
    for m in (plain, model):
        m.eval()
        m(x)  # eval forwards are not steps
        m.train()
        with torch.no_grad():
            m(x)  # a training-mode forward without gradients is a step with forward records only
    assert got.events == [e if e[0] != "start" else (*e[:2], "ortcore") for e in expected.events]
    assert not got.backward
    assert_same_tensors(expected.forward, got.forward, "forward")


def run_statistics(model, out_dir, steps=4, **train_kwargs):
    GlobalSubscriberManager.subscribe(model, [activation_stats.StatisticsSubscriber(out_dir)])
    train(model, steps=steps, **train_kwargs)
    GlobalSubscriberManager.unsubscribe(model)


def test_statistics_of_ortmodule_and_torch_runs_do_not_diverge(host, tmp_path):
    torch.manual_seed(0)
    plain = ActivationNet()
    wrapped = ORTModule(copy.deepcopy(plain), host=host)
    run_statistics(plain, tmp_path / "pt_out")
    run_statistics(wrapped, tmp_path / "ort_out")
    meta = json.loads((tmp_path / "ort_out" / "meta.json").read_text())
    assert meta["source"] == "ortcore"
    report = find_divergence(tmp_path / "pt_out", tmp_path / "ort_out")
    assert not report.diverged, report.summary()
    assert report.steps == [0, 1, 2, 3] and report.compared == 4 * 2 * len(NAMES)


PERTURB = {"on": False}


def _perturb_block_fc(model: onnx.ModelProto, context) -> None:
    """Multiply the output of block.fc's Gemm by 1.01: a small real discrepancy inside the graph ORT runs."""
    if not PERTURB["on"]:
        return
    nodes = list(model.graph.node)
    index, node = next((i, n) for i, n in enumerate(nodes) if n.op_type == "Gemm" and "/block/fc/" in n.name)
    out = node.output[0]
    node.output[0] = out + "_unperturbed"
    scale = onnx.helper.make_node(
        "Constant", [], [out + "_scale"], value=onnx.helper.make_tensor("scale", onnx.TensorProto.FLOAT, [], [1.01])
    )
    mul = onnx.helper.make_node("Mul", [out + "_unperturbed", out + "_scale"], [out], name="perturb")
    del model.graph.node[:]
    model.graph.node.extend([*nodes[: index + 1], scale, mul, *nodes[index + 1 :]])


def test_injected_discrepancy_is_named_with_its_step(tmp_path):
    perturber = types.SimpleNamespace(
        ortcore_graph_passes=hookimpl(lambda: [GraphPass("perturb_block_fc", run=_perturb_block_fc)])
    )
    host = make_host({"activation_stats": activation_stats, "perturber": perturber})
    previous = set_host(host)
    try:
        torch.manual_seed(0)
        plain = ActivationNet()
        # The audit off: it would catch the injected difference on its first step and run the module in PyTorch.
        wrapped = ORTModule(copy.deepcopy(plain), host=host, verify_gradients=False)
        run_statistics(plain, tmp_path / "pt_out", steps=4)

        GlobalSubscriberManager.subscribe(wrapped, [activation_stats.StatisticsSubscriber(tmp_path / "ort_out")])
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        for step in range(4):
            if step == 2:  # from step 2 on, ORT runs the perturbed graph
                PERTURB["on"] = True
                wrapped.state_machine.reset("perturbation switched on")
            wrapped(torch.randn(5, 4, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        GlobalSubscriberManager.unsubscribe(wrapped)
    finally:
        PERTURB["on"] = False
        set_host(previous)

    report = find_divergence(tmp_path / "pt_out", tmp_path / "ort_out")
    assert report.diverged
    first = report.first
    assert (first.step, first.kind, first.name) == (2, "forward", "block.fc")
    mean = next(m for m in first.mismatches if m.stat == "mean")
    assert mean.ort == pytest.approx(mean.pt * 1.01, rel=1e-4)
    firsts = {(s.kind, s.name): s.first_divergent_step for s in report.worst}
    assert min(step for step in firsts.values() if step is not None) == 2  # steps 0 and 1: unperturbed graph
    assert firsts.get(("forward", "embed")) in (None, 3)  # upstream of the perturbation: equal at step 2
    assert firsts[("backward", "embed")] == 2  # ... but its gradient flows back through it


@pytest.mark.parametrize("torch_kernels", [False, True], ids=["ort-kernels", "aten-fallback"])
def test_gpt2_activations_from_ortmodule_match_torch(host, torch_kernels):
    transformers = pytest.importorskip("transformers")
    if torch_kernels:  # ATen nodes: ORT cannot infer their output types, which the exporter's must then give
        import ortcore_plugins.aten_fallback as aten_fallback

        host = make_host({"activation_stats": activation_stats, "aten_fallback": aten_fallback})
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    wrapped = ORTModule(copy.deepcopy(plain), host=host)
    expected, got = Recorder(), Recorder()
    GlobalSubscriberManager.subscribe(plain, [expected])
    GlobalSubscriberManager.subscribe(wrapped, [got])
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for model in (plain, wrapped):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    assert wrapped.state_machine.counters.fallbacks == 0, wrapped.fallback_reason
    names = {name for _, name in expected.forward}
    assert "GPT2LMHeadModel['logits']" in names and "transformer.h.1.attn.c_attn" in names
    assert_same_tensors(expected.forward, got.forward, "forward")
    assert_same_tensors(expected.backward, got.backward, "gradient")


def test_documented_example_names_the_perturbed_module(tmp_path, capsys):
    """docs/convergence_example.py, as docs/convergence.md runs it (shorter)."""
    import runpy

    pytest.importorskip("transformers")
    example = runpy.run_path(str(Path(__file__).parents[1] / "docs" / "convergence_example.py"))
    code = example["main"](
        ["--out", str(tmp_path), "--steps", "4", "--perturb", "transformer.h.1.mlp.c_fc", "--from-step", "2"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "first divergence: step 2, rank 0, forward activation 'transformer.h.1.mlp.c_fc'" in out
    assert (tmp_path / "report.html").stat().st_size > 0 and (tmp_path / "first_divergence.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "summaries").iterdir()) == [f"step_{i}.txt" for i in range(4)]


def test_deepcopy_before_export_keeps_the_subscribers(host, monkeypatch):
    class Uncopyable(Recorder):
        def __deepcopy__(self, memo):
            raise TypeError("holds an open file")

        def on_unsubscribe(self, model):
            self.events.append(("unsubscribed", type(model).__name__))

    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "1")
    model = ActivationNet()
    recorder = Uncopyable()
    GlobalSubscriberManager.subscribe(model, [recorder])
    wrapped = ORTModule(model, host=make_host({"activation_stats": activation_stats}, env=dict(os.environ)))
    assert wrapped.runtime_options.deepcopy_before_export
    train(wrapped, steps=1)
    assert wrapped.state_machine.counters.fallbacks == 0, wrapped.fallback_reason
    assert {name for _, name in recorder.forward} == NAMES and {name for _, name in recorder.backward} == NAMES
    GlobalSubscriberManager.unsubscribe(wrapped)
    assert recorder.events[-2:] == [("end", 0), ("unsubscribed", "ActivationNet")]


def test_subscribing_with_the_subscriber_manager_disabled_says_so(monkeypatch) -> None:
    monkeypatch.setenv("ORTCORE_DISABLE_PLUGINS", "subscriber_manager")
    model = ActivationNet()
    with pytest.raises(PluginError, match=r"cannot subscribe ActivationNet: the subscriber_manager plugin is disabled"):
        GlobalSubscriberManager.subscribe(model, [SubscriberBase()])
    assert not GlobalSubscriberManager.is_subscribed(model)
    assert recorder_of(model) is None


def test_a_subscription_is_the_models_step_recorder_until_unsubscribed(host) -> None:
    model = ActivationNet()
    GlobalSubscriberManager.subscribe(model, [SubscriberBase()], host=host)
    try:
        recorder = recorder_of(model)
        assert recorder is not None and recorder.next_step_active()
        wrapped = ORTModule(model, host=host)
        assert recorder_of(wrapped.module) is recorder
    finally:
        GlobalSubscriberManager.unsubscribe(model)
    assert recorder_of(model) is None
