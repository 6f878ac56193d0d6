"""The export state machine: what re-exports, what only rebuilds the session, what reuses a cached graph, and why.

``model.state_machine.counters`` counts exports, builds, reuses and fallbacks; ``model.state_machine.history``
lists every transition with its reason. Every call's result is also compared with PyTorch.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from ortcore import DebugOptions, LogLevel, ORTModule

RTOL, ATOL = 1e-4, 1e-5


def assert_close(actual, expected, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


class Encoder(nn.Module):
    """Works on any rank and length; casts its input, so float32 and float64 inputs are both valid."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0, **extra):
        y = self.fc2(torch.relu(self.fc1(self.drop(x.float())))) * scale
        if mask is not None:
            y = y * mask
        for value in extra.values():
            y = y + value
        return y


class Tracked:
    """An ORTModule and the same model in PyTorch, called together; remembers where the history stood."""

    def __init__(self, **kwargs):
        model = Encoder()
        kwargs.setdefault("fallback_policy", "FALLBACK_DISABLE")
        self.ort = ORTModule(copy.deepcopy(model), **kwargs)
        self.ref = model
        self.mark = 0

    def __call__(self, *args, backward: bool = True, **kwargs) -> torch.Tensor:
        """Run both models; compare outputs and (when grad is on) parameter gradients."""
        out = self.ort(*args, **kwargs)
        expected = self.ref(*args, **kwargs)
        assert_close(out, expected)
        if backward and torch.is_grad_enabled() and expected.requires_grad:
            self.ort.zero_grad()
            self.ref.zero_grad()
            out.sum().backward()
            expected.sum().backward()
            for (name, p), (_, q) in zip(self.ort.named_parameters(), self.ref.named_parameters()):
                if q.grad is None:
                    assert p.grad is None or not p.grad.any(), name
                else:
                    assert_close(p.grad, q.grad, msg=f"gradient of {name}")
        return out

    @property
    def counters(self):
        return self.ort.state_machine.counters

    def counts(self) -> tuple[int, int]:
        return self.counters.exports, self.counters.builds

    def new_transitions(self) -> list[tuple[str, str]]:
        """Transitions since the last call of this method, as ``(action, reason)``."""
        history = self.ort.state_machine.history
        new = [(t.action, t.reason) for t in history[self.mark :]]
        self.mark = len(history)
        return new

    def set_requires_grad(self, name: str, flag: bool) -> None:
        for model in (self.ort, self.ref):
            dict(model.named_parameters())[name].requires_grad_(flag)


def reasons(transitions: list[tuple[str, str]], action: str) -> str:
    return " | ".join(reason for a, reason in transitions if a == action)


# -- what does not re-export ----------------------------------------------------------------------------------------


def test_batch_size_change_exports_once_more_then_reuses_graph():
    """dynamic_shapes = "auto": the first graph has the first call's sizes; the first call that changes a dimension
    gets a graph dynamic in it, which serves every later size."""
    m = Tracked()
    m(torch.randn(2, 4))
    graph, _ = m.ort.state_machine.current
    assert [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.model.graph.input[:1]] == [[2, 4]]
    m.new_transitions()
    for batch in (5, 1, 7, 2):
        m(torch.randn(batch, 4))
    assert m.counts() == (2, 2)
    assert m.counters.reuses == 3
    assert "input sizes changed: now dynamic in x dimension 0" in reasons(m.new_transitions(), "export")
    graph, _ = m.ort.state_machine.current
    dims = graph.model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].HasField("dim_value") and dims[1].dim_value == 4


def test_dynamic_shapes_always_exports_one_graph_for_every_size():
    from ortcore.config import Config
    from ortcore.host import PluginHost

    m = Tracked(host=PluginHost(Config.load(env={"ORTCORE_DYNAMIC_SHAPES": "always"}, search=False)))
    for batch in (2, 5, 1, 7):
        m(torch.randn(batch, 4))
    assert m.counts() == (1, 1)
    assert m.counters.reuses == 3


def test_a_static_graph_has_no_run_time_broadcast_gradients():
    """With the sizes known, ORT's gradient of a broadcasting Add reduces over axes fixed at build time: no
    BroadcastGradientArgs, and no ReduceSum for the side that is not broadcast (the bias's only)."""
    from ortcore.config import Config
    from ortcore.host import PluginHost

    class Residual(nn.Module):  # the layer norm runs as an ATen node: ONNX's shape inference knows no size after it
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.norm(x)
            return self.fc(h) + h

    counts = {}
    x = torch.randn(3, 5, 4)
    for mode in ("auto", "always"):
        model = Residual()
        ort = ORTModule(
            copy.deepcopy(model),
            fallback_policy="FALLBACK_DISABLE",
            host=PluginHost(Config.load(env={"ORTCORE_DYNAMIC_SHAPES": mode}, search=False)),
        )
        out = ort(x)
        expected = model(x)
        assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), q in zip(ort.named_parameters(), model.parameters()):
            assert_close(p.grad, q.grad, msg=f"{mode}: gradient of {name}")
        _, session = ort.state_machine.current
        ops = [n.op_type for n in session.model.graph.node]
        counts[mode] = (ops.count("BroadcastGradientArgs"), ops.count("ReduceSum"))
    assert counts["auto"][0] == 0 and counts["always"][0] > 0, counts
    assert counts["auto"][1] < counts["always"][1], counts


def test_bad_dynamic_shapes_value_is_refused():
    from ortcore.config import Config
    from ortcore.errors import OptionError

    with pytest.raises(OptionError, match=r"ORTCORE_DYNAMIC_SHAPES='sometimes' is not allowed; allowed: auto .* always"):
        Config.load(env={"ORTCORE_DYNAMIC_SHAPES": "sometimes"}, search=False)


def test_dropping_sessions_builds_again_without_exporting():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.new_transitions()
    m.ort.state_machine.drop_sessions("a session setting changed")
    m(x)  # compared with PyTorch: outputs and gradients
    assert m.counts() == (1, 2)  # one export, a second build
    transitions = m.new_transitions()
    assert reasons(transitions, "reset") == "sessions only: a session setting changed"
    assert reasons(transitions, "export") == "" and reasons(transitions, "build")


def test_sequence_length_change_reuses_graph_once_dynamic():
    m = Tracked()
    for length in (3, 9, 1, 3, 12):
        m(torch.randn(2, length, 4))
    assert m.counts() == (2, 2)


def test_same_python_scalar_reuses_graph():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x, scale=2.0)
    m(x, scale=2.0)
    assert m.counts() == (1, 1)


def test_a_call_spelled_otherwise_is_traced_as_made():
    # The same arguments passed otherwise can change what the forward sees (a decorator reading kwargs), so each
    # spelling gets a graph of its own; each is reused.
    m = Tracked()
    x = torch.randn(3, 4)
    m(x, scale=2.0)
    m(x, None, 2.0)
    m(x, None, 2.0)
    m(x, scale=2.0)
    assert m.counts() == (2, 2)


# -- what re-exports, and says why -----------------------------------------------------------------------------------


def test_extra_keyword_argument_reexports():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.new_transitions()
    m(x, bias=torch.randn(4))
    assert m.counts() == (2, 2)
    why = reasons(m.new_transitions(), "export")
    assert "structure" in why and "bias" in why


def test_none_versus_tensor_argument_reexports():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x, None)
    m.new_transitions()
    m(x, torch.ones(3, 4))
    assert m.counts() == (2, 2)
    assert "mask" in reasons(m.new_transitions(), "export")


def test_reexport_reason_does_not_blame_unchanged_constants():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x, None, 1.0)
    m.new_transitions()
    m(x, torch.ones(3, 4), 1.0)
    why = reasons(m.new_transitions(), "export")
    assert "mask" in why
    assert "1.0" not in why, why  # scale did not change


def test_input_dtype_change_reexports():
    m = Tracked()
    m(torch.randn(3, 4))
    m.new_transitions()
    m(torch.randn(3, 4, dtype=torch.float64))
    assert m.counts() == (2, 2)
    why = reasons(m.new_transitions(), "export")
    assert "dtype" in why and "float64" in why


def test_input_rank_change_reexports():
    m = Tracked()
    m(torch.randn(3, 4))
    m.new_transitions()
    m(torch.randn(2, 3, 4))
    assert m.counts() == (2, 2)
    why = reasons(m.new_transitions(), "export")
    assert "rank 2->3" in why


def test_python_scalar_change_reexports():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x, scale=2.0)
    m.new_transitions()
    m(x, scale=3.0)
    assert m.counts() == (2, 2)
    why = reasons(m.new_transitions(), "export")
    assert "non-tensor" in why and "2.0" in why and "3.0" in why


def test_train_to_eval_reexports():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.new_transitions()
    m.ort.eval()
    m.ref.eval()
    m(x)
    assert m.counts() == (2, 2)
    assert "train->eval" in reasons(m.new_transitions(), "export")


# -- what only rebuilds the session -----------------------------------------------------------------------------------


def test_parameter_requires_grad_flip_rebuilds_without_export():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.new_transitions()
    m.set_requires_grad("fc1.weight", False)
    m(x)
    assert m.ort.fc1.weight.grad is None
    assert m.counts() == (1, 2)
    transitions = m.new_transitions()
    assert [a for a, _ in transitions] == ["build"]
    assert "fc1.weight off" in reasons(transitions, "build")


def test_input_requires_grad_flip_rebuilds_without_export():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.new_transitions()
    x_ort = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    m.ort(x_ort).sum().backward()
    m.ref(x_ref).sum().backward()
    assert_close(x_ort.grad, x_ref.grad)
    assert m.counts() == (1, 2)
    transitions = m.new_transitions()
    assert [a for a, _ in transitions] == ["build"]
    assert "input x on" in reasons(transitions, "build")


def test_grad_mode_change_rebuilds_without_export():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.new_transitions()
    with torch.no_grad():
        out = m(x)
    assert not out.requires_grad
    assert m.counts() == (1, 2)
    transitions = m.new_transitions()
    assert [a for a, _ in transitions] == ["build"]
    assert "no_grad" in reasons(transitions, "build")


# -- caching -----------------------------------------------------------------------------------------------------------


def test_returning_to_seen_key_reuses_cached_graph():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.ort.eval()
    m.ref.eval()
    m(x)
    with torch.no_grad():
        m(x)
    m.set_requires_grad("fc2.bias", False)
    m.ort.train()
    m.ref.train()
    m(x)
    m.set_requires_grad("fc2.bias", True)
    seen = m.counts()
    m.new_transitions()
    m(x)  # training, all trainable: the first key
    m.ort.eval()
    m.ref.eval()
    m(x)
    with torch.no_grad():
        m(x)
    assert m.counts() == seen
    transitions = m.new_transitions()
    assert [a for a, _ in transitions] == ["reuse", "reuse", "reuse"]


def test_returning_to_seen_dtype_reuses_cached_graph():
    m = Tracked()
    m(torch.randn(3, 4))
    m(torch.randn(3, 4, dtype=torch.float64))
    m(torch.randn(3, 4))
    m(torch.randn(3, 4, dtype=torch.float64))
    assert m.counts() == (2, 2)
    assert [t.action for t in m.ort.state_machine.history[-2:]] == ["reuse", "reuse"]


def test_repeated_calls_with_same_key_add_no_history():
    m = Tracked()
    x = torch.randn(3, 4)
    m(x)
    m.new_transitions()
    for _ in range(3):
        m(x)
    assert m.new_transitions() == []
    assert m.counts() == (1, 1)


# -- logging -------------------------------------------------------------------------------------------------------


def test_transition_reasons_are_logged_at_info(caplog: pytest.LogCaptureFixture):
    m = Tracked(debug_options=DebugOptions(log_level=LogLevel.INFO))
    with caplog.at_level(logging.INFO, logger="ortcore"):
        x = torch.randn(3, 4)
        m(x)
        m(x, scale=3.0)
        m(torch.randn(2, 3, 4), scale=3.0)
        m.ort.eval()
        m.ref.eval()
        m(x, scale=3.0)
    messages = [r.getMessage() for r in caplog.records if r.name == "ortcore" and r.levelno == logging.INFO]
    assert any("first call" in msg for msg in messages), messages
    assert any("non-tensor" in msg and "3.0" in msg for msg in messages), messages
    assert any("rank 2->3" in msg for msg in messages), messages
    assert any("train->eval" in msg for msg in messages), messages


def test_log_records_reach_root_logger_handlers():
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root = logging.getLogger()
    handler = Collect(level=logging.INFO)
    root.addHandler(handler)  # what logging.basicConfig(filename=...) does in a training script
    try:
        m = Tracked(debug_options=DebugOptions(log_level=LogLevel.INFO))
        m(torch.randn(3, 4))
    finally:
        root.removeHandler(handler)
    assert any(r.name == "ortcore" and "first call" in r.getMessage() for r in records)


def test_transitions_are_not_logged_at_warning(caplog: pytest.LogCaptureFixture):
    m = Tracked(debug_options=DebugOptions(log_level=LogLevel.WARNING))
    with caplog.at_level(logging.DEBUG):
        m(torch.randn(3, 4))
        m(torch.randn(2, 3, 4))
    assert [r.getMessage() for r in caplog.records if r.name == "ortcore"] == []


def test_a_cached_graph_that_does_not_build_for_new_requires_grad_is_exported_again():
    """aten_fallback routes LayerNorm to PyTorch only when its input needs a gradient (an ORT rule for ATen
    gradients): freezing the layer below after the first export needs a new export, not just a rebuild."""
    import ortcore_plugins.aten_fallback as aten
    from ortcore.testing import make_host

    reference = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    model = ORTModule(
        copy.deepcopy(reference), host=make_host({"aten_fallback": aten}), fallback_policy="FALLBACK_DISABLE"
    )
    x = torch.randn(5, 4)
    model(x).sum().backward()
    for m in (model, reference):
        m.zero_grad()
        m[0].requires_grad_(False)
    out, expected = model(x), reference(x)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert model.state_machine.counters.exports == 2
    assert any(t.action == "export" and "did not build" in t.reason for t in model.state_machine.history)
