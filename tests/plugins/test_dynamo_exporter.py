"""Choosing the exporter by name (option, environment, ORTModule keyword), the errors for unknown names and a
missing onnxscript, the switch to the dynamo route on a torch without the TorchScript exporter, and the dynamo
route's contract: PyTorch's loss and gradients, parameters as named inputs, no re-export across batch sizes."""

from __future__ import annotations

import copy
import importlib
import logging

import onnx
import pytest
import torch
from torch import nn

import ortcore.exporter as core_exporter
import ortcore_plugins.dynamo_exporter as plugin
from ortcore import ORTModule
from ortcore.errors import OptionError, UnsupportedModelError
from ortcore.hookspecs import hookimpl
from ortcore.testing import make_host
from ortcore_plugins.torchscript_exporter import TorchScriptExporter

pytest.importorskip("onnxscript")


class Net(nn.Module):
    """Linear, LayerNorm, GELU and cross-entropy: the ops whose ORT gradients need the dynamo graph's fixes."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.ln = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc2(nn.functional.gelu(self.ln(self.fc1(x)))), y)


# This route's own refusals, without the repair that exports such a model with the TorchScript exporter instead.
NO_TORCHSCRIPT_REPAIR = {plugin.ENV_TORCHSCRIPT_REPAIR: "0"}


def dynamo_host(**kwargs):
    return make_host({plugin.NAME: plugin}, **kwargs)


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


# -- choosing the exporter -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how",
    ["keyword", "table", "env"],
)
def test_dynamo_is_chosen_by_keyword_table_or_environment(how):
    kwargs = {"table": {"exporter": "dynamo"}} if how == "table" else {}
    if how == "env":
        kwargs = {"env": {"ORTCORE_EXPORTER": "dynamo"}}
    model = ORTModule(Net(), host=dynamo_host(**kwargs), **({"exporter": "dynamo"} if how == "keyword" else {}))
    assert isinstance(model._ortcore.exporter, plugin.DynamoExporter)
    model(*batch(4, 0))
    assert model.state_machine.last_key.exporter == "dynamo"


def test_torchscript_stays_the_default():
    model = ORTModule(Net(), host=dynamo_host())
    assert type(model._ortcore.exporter) is TorchScriptExporter and model._ortcore.exporter.name == "torchscript"


def test_unknown_exporter_name_lists_the_offered_ones():
    with pytest.raises(OptionError, match=r"exporter='onnxlite' \(argument\) is not allowed; .*: dynamo, torchscript"):
        ORTModule(Net(), host=dynamo_host(), exporter="onnxlite")
    with pytest.raises(OptionError, match=r"exporter='dynamo' .* offered by the loaded plugins: torchscript"):
        ORTModule(Net(), host=make_host({}, env={"ORTCORE_EXPORTER": "dynamo"}))
    with pytest.raises(OptionError, match=r"ORTCORE_EXPORTER='dyn amo' is not allowed; expected an exporter's name"):
        make_host({}, env={"ORTCORE_EXPORTER": "dyn amo"})
    with pytest.raises(TypeError, match=r"exporter=42 is not allowed; expected an exporter's name"):
        ORTModule(Net(), host=dynamo_host(), exporter=42)


def test_a_plugin_offers_a_named_exporter():
    class Named(TorchScriptExporter):
        name = "named"

    class Offers:
        @hookimpl
        def ortcore_register(self, config, register):
            register.exporter("named", lambda config: Named())

    host = make_host({"offers": Offers()}, table={"exporter": "named"})
    assert type(ORTModule(Net(), host=host)._ortcore.exporter) is Named
    assert sorted(host.hooks.exporters()) == ["named", "torchscript"]


def test_without_the_torchscript_exporter_ortcore_switches_to_dynamo(monkeypatch):
    monkeypatch.setattr(core_exporter, "torchscript_available", lambda: False)
    monkeypatch.setattr(core_exporter, "_switch_logged", False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("ortcore")
    logger.addHandler(handler)
    try:
        first = ORTModule(Net(), host=dynamo_host(env={"ORTMODULE_LOG_LEVEL": "INFO"}))
        second = ORTModule(Net(), host=dynamo_host(env={"ORTMODULE_LOG_LEVEL": "INFO"}))
    finally:
        logger.removeHandler(handler)
    assert isinstance(first._ortcore.exporter, plugin.DynamoExporter)
    assert isinstance(second._ortcore.exporter, plugin.DynamoExporter)
    switched = [r for r in records if "no TorchScript exporter" in r.getMessage()]
    assert len(switched) == 1 and switched[0].levelno == logging.INFO


def test_missing_onnxscript_is_named(monkeypatch):
    monkeypatch.setattr(plugin, "_missing_package", lambda: "onnxscript")
    host = dynamo_host(env=NO_TORCHSCRIPT_REPAIR)
    model = ORTModule(Net(), host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(UnsupportedModelError, match=r"needs the package 'onnxscript'.*pip install onnxscript"):
        model(*batch(4, 0))


# -- the route's contract ------------------------------------------------------------------------------------------


def test_dynamo_route_trains_like_pytorch_without_reexporting():
    """Loss and every gradient equal PyTorch's over 6 SGD steps with changing batch sizes (rtol 1e-5, atol 1e-6),
    all from one export."""
    torch.manual_seed(0)
    reference = Net()
    model = ORTModule(
        copy.deepcopy(reference), host=dynamo_host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE"
    )
    ours = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, n in enumerate([4, 7, 4, 9, 2, 7]):
        x, y = batch(n, step)
        loss, expected = model(x, y), reference(x, y)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    assert model.state_machine.counters.exports == 2  # the first call's sizes, then one graph dynamic in the dimension a call changed


def test_graph_takes_parameters_as_named_inputs_and_has_the_outputs_ort_needs():
    model = ORTModule(Net(), host=dynamo_host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    model(*batch(4, 0))
    graph = next(iter(model.state_machine._graphs.values())).model.graph
    names = [i.name for i in graph.input]
    assert names[:2] == ["x", "y"] and names[2:] == [n for n, _ in model.named_parameters()]
    outputs = {
        n.op_type: len(n.output) for n in graph.node if n.op_type in ("LayerNormalization", "SoftmaxCrossEntropyLoss")
    }
    assert outputs == {"LayerNormalization": 3, "SoftmaxCrossEntropyLoss": 2}
    batch_dim = graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_value == 4  # the first call's sizes (dynamic_shapes = "auto"); test_state_machine has the rest


# -- the route's seam: plugins' translations and program passes ---------------------------------------------------

_seam_library = torch.library.Library("ortcore_seam_test", "FRAGMENT")
_seam_library.define("scaled(Tensor x, float k) -> Tensor")
_seam_library.impl("scaled", lambda x, k: x * k, "CompositeImplicitAutograd")


class UsesScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(torch.ops.ortcore_seam_test.scaled(self.fc(x), 0.5), y)


class SeamPlugin:
    """A third-party plugin extending the dynamo route: a pass over the exported program and a translation."""

    def __init__(self):
        self.seen_in_program: list[str] = []
        self.translated: list[float] = []

    def _count(self, program, context) -> None:
        assert isinstance(program, torch.export.ExportedProgram) and context.training
        self.seen_in_program += [
            str(n.target) for n in program.graph.nodes if "ortcore_seam_test" in str(getattr(n, "target", ""))
        ]

    @hookimpl
    def ortcore_program_passes(self, config):
        from ortcore.graph_passes import GraphPass

        return [GraphPass("seam_test.count", run=self._count)]

    @hookimpl
    def ortcore_export_translations(self, config):
        from onnxscript import opset18 as op

        def scaled(x, k: float):
            self.translated.append(k)
            return op.Mul(x, op.CastLike(op.Constant(value_float=k), x))

        return {torch.ops.ortcore_seam_test.scaled.default: scaled}


def test_plugins_translate_ops_and_see_the_exported_program():
    """A plugin's op is kept whole through decomposition and translated by the plugin's function; its program pass
    runs on the exported program first. Loss and gradients equal PyTorch's (rtol 1e-5, atol 1e-6)."""
    torch.manual_seed(0)
    reference = UsesScaled()
    seam = SeamPlugin()
    host = make_host({plugin.NAME: plugin, "seam_test": seam})
    model = ORTModule(copy.deepcopy(reference), host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    x, y = batch(5, 0)
    loss, expected = model(x, y), reference(x, y)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert seam.seen_in_program == ["ortcore_seam_test.scaled.default"]
    assert seam.translated == [0.5]


def test_translation_table_is_built_once_and_plugins_translations_stay_per_export(monkeypatch):
    """torch.onnx's own table of translations is built once per process; a plugin's translation goes into the copy
    one export uses, never into the shared table."""
    from torch.onnx._internal.exporter import _registration

    built = []
    original = _registration.ONNXRegistry.from_torchlib.__func__

    def counting(cls, *args, **kwargs):
        built.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(counting))
    monkeypatch.setattr(plugin, "_base_registries", {})
    seam = SeamPlugin()
    host = make_host({plugin.NAME: plugin, "seam_test": seam})
    for _ in range(2):
        model = ORTModule(UsesScaled(), host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
        model(*batch(4, 0)).backward()
    assert len(built) == 1 and seam.translated == [0.5, 0.5]
    shared = plugin._base_registries[18]
    assert not shared.is_registered(torch.ops.ortcore_seam_test.scaled.default)


# -- what torch.export does differently ----------------------------------------------------------------------------


class Triple(torch.autograd.Function):
    """Forward doubles, backward triples: differentiating the forward would give 2, PyTorch gives 3."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class UsesFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Triple.apply(self.fc(x)).sum()


def test_custom_autograd_function_is_refused_not_differentiated_wrongly():
    host = dynamo_host(env=NO_TORCHSCRIPT_REPAIR)
    model = ORTModule(UsesFunction(), host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(UnsupportedModelError, match=r"custom autograd Function\(s\) .*Triple: torch.export traces"):
        model(torch.randn(3, 4))


def test_custom_autograd_function_falls_back_to_pytorch_by_default_policy():
    """With the default fallback policy the model runs in PyTorch: the Function's own backward (3, not 2)."""
    torch.manual_seed(0)
    reference = UsesFunction()
    model = ORTModule(copy.deepcopy(reference), host=dynamo_host(), exporter="dynamo")
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match=r"running UsesFunction in PyTorch.*Triple"):
        model(x).backward()
    reference(x).backward()
    torch.testing.assert_close(model.fc.bias.grad, reference.fc.bias.grad, rtol=0, atol=0)
    torch.testing.assert_close(reference.fc.bias.grad, torch.full((4,), 9.0))  # 3 rows x backward's 3


def test_custom_autograd_function_traced_through_when_asked():
    """ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0: traced through on both routes: the forward's derivative (2 per row)."""
    # Not torch's gradient on purpose (the Function's backward is skipped): the audit would rightly refuse it.
    host = dynamo_host(env={"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "0", "ORTCORE_VERIFY_GRADIENTS": "0"})
    model = ORTModule(UsesFunction(), host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    model(torch.randn(3, 4)).backward()
    torch.testing.assert_close(model.fc.bias.grad, torch.full((4,), 6.0))


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.fc1(t)), x, use_reentrant=False)
        return self.fc2(h).sum()


def test_checkpointed_model_trains_like_pytorch():
    torch.manual_seed(0)
    reference = Checkpointed()
    model = ORTModule(
        copy.deepcopy(reference), host=dynamo_host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE"
    )
    x = torch.randn(5, 4)
    loss, expected = model(x), reference(x)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent: no graph break is possible on this route
            h = h * 2
        return h.sum()


REFUSE_VALUE_BRANCHES = {plugin.ENV_VALUE_BRANCHES: "0", **NO_TORCHSCRIPT_REPAIR}


@pytest.mark.parametrize("model_class", ["Branches", "CountsLabels"])
def test_a_branch_on_a_tensor_value_is_taken_as_the_batch_takes_it(model_class, caplog):
    """torch.export refuses Python branches on a tensor's value (no graph break inside one graph); the capture is
    repeated with the batch's values at hand (draft_export), the branch this batch takes is in the graph, and a
    WARNING names the line. Gradients are eager's for that batch."""
    module = Branches() if model_class == "Branches" else CountsLabels()
    reference = copy.deepcopy(module)
    model = ORTModule(module, host=dynamo_host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    inputs = (torch.randn(3, 4),) if model_class == "Branches" else (torch.randn(3, 4), torch.tensor([0, 2, 1]))
    with caplog.at_level(logging.WARNING, logger="ortcore"):
        loss = model(*inputs)
    loss.backward()
    expected = reference(*inputs)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    warned = [r.getMessage() for r in caplog.records if "decision(s) on tensor values" in r.getMessage()]
    assert warned and "test_dynamo_exporter.py:" in warned[0], warned
    assert ("if h.sum() > 0" if model_class == "Branches" else "if kept.size(0) > 0") in warned[0]


def test_data_dependent_control_flow_error_names_the_line():
    model = ORTModule(
        Branches(), host=dynamo_host(env=REFUSE_VALUE_BRANCHES), exporter="dynamo", fallback_policy="FALLBACK_DISABLE"
    )
    with pytest.raises(
        UnsupportedModelError, match=r"test_dynamo_exporter.py\", line \d+, in forward: if h.sum\(\) > 0.*torch.cond"
    ):
        model(torch.randn(3, 4))


class CountsLabels(nn.Module):
    """Hugging Face DeBERTa's loss code: a branch on the size of a ``nonzero`` result."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.fc(x)
        kept = (labels >= 0).nonzero()
        if kept.size(0) > 0:
            return nn.functional.cross_entropy(logits, labels)
        return logits.sum() * 0


def test_data_dependent_size_error_names_the_models_line():
    """torch.export's message names no line for a guard on a data-dependent size; the model's frame is found in the
    error's traceback instead."""
    model = ORTModule(
        CountsLabels(),
        host=dynamo_host(env=REFUSE_VALUE_BRANCHES),
        exporter="dynamo",
        fallback_policy="FALLBACK_DISABLE",
    )
    with pytest.raises(
        UnsupportedModelError,
        match=r"test_dynamo_exporter.py\", line \d+, in forward: if kept.size\(0\) > 0.*torch.cond",
    ):
        model(torch.randn(3, 4), torch.tensor([0, 2, 1]))


def test_a_model_torch_export_cannot_capture_is_repaired_with_the_torchscript_exporter(caplog):
    """With value branches off, torch.export refuses the model; the repair exports it with the TorchScript exporter
    (everything still in ORT), says so at WARNING, lists it in ``repairs``, and the loss and every gradient equal
    PyTorch's over three AdamW steps (rtol 1e-5, atol 1e-6)."""
    module = CountsLabels()
    reference = copy.deepcopy(module)
    env = {plugin.ENV_VALUE_BRANCHES: "0"}
    model = ORTModule(module, host=dynamo_host(env=env), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference)]
    x, labels = torch.randn(3, 4), torch.tensor([0, 2, 1])
    with caplog.at_level(logging.WARNING, logger="ortcore"):
        for _ in range(3):
            losses = []
            for m, optimizer in zip((model, reference), optimizers):
                optimizer.zero_grad()
                loss = m(x, labels)
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
            for optimizer in optimizers:
                optimizer.step()
    assert [(r.plugin, dict(r.options), r.kind) for r in model.repairs] == [
        ("core", {"exporter": "torchscript"}, "exporter")
    ]
    assert "could not export CountsLabels" in model.repairs[0].reason
    warned = [r.getMessage() for r in caplog.records if "TorchScript exporter instead" in r.getMessage()]
    assert len(warned) == 1, warned
    assert model.state_machine.counters.repairs == 1


def test_the_torchscript_repair_comes_before_regions_for_a_capture_failure_or_a_wrong_gradient_only():
    """torch.export's and onnxscript's failures are this route's own, and so is a wrong gradient the audit finds in
    its graph: the other exporter comes before moving modules to PyTorch. A build or run failure, or a refusal both
    routes make (a buffer write), tries the regions first and the other exporter last."""
    from ortcore.repair import CORE_REPAIR, Failure, Repair, order_repairs

    config = dynamo_host().config.with_code_options(None, exporter="dynamo")
    region = Repair("block in PyTorch", "region_routing", {"modules": ["block"]}, kind="region")
    op = Repair("aten::cdist in PyTorch", "aten_fallback", {"ops": ["aten::cdist"]}, kind="op")
    capture = Failure(stage="export", message="the dynamo exporter could not export M: no", modules=("block",))
    for failure in (capture, Failure(stage="audit", message="gradients differ", modules=("block",))):
        offered = plugin.ortcore_repairs(config, failure)
        assert [(r.plugin, dict(r.options)) for r in offered] == [(CORE_REPAIR, {"exporter": "torchscript"})]
        assert order_repairs([region, *offered, op]) == [op, *offered, region]
    for failure in (
        Failure(stage="export", message="BufferWriteError: the dynamo exporter traced a forward that writes"),
        Failure(stage="build", message="ONNX Runtime could not build the training graph: DFT"),
        Failure(stage="run", message="ONNX Runtime failed to run the first step"),
    ):
        late = plugin.ortcore_repairs(config, failure)
        assert order_repairs([region, *late, op]) == [op, region, *late], failure.stage
    off = dynamo_host(env={plugin.ENV_TORCHSCRIPT_REPAIR: "0"}).config.with_code_options(None, exporter="dynamo")
    assert plugin.ortcore_repairs(off, capture) is None
    torchscript = dynamo_host().config.with_code_options(None, exporter="torchscript")
    assert plugin.ortcore_repairs(torchscript, capture) is None


def test_a_core_repair_is_validated_and_wins_over_the_environment():
    from ortcore.errors import OptionError

    config = dynamo_host(env={"ORTCORE_EXPORTER": "dynamo"}).config
    assert config.core.exporter == "dynamo"
    repaired = config.with_repaired_core({"exporter": "torchscript"})
    assert repaired.core.exporter == "torchscript" and repaired.sources["core.exporter"] == "repair"
    with pytest.raises(OptionError, match=r"unknown core option 'exportr'.*Did you mean 'exporter'"):
        config.with_repaired_core({"exportr": "torchscript"})
    with pytest.raises(OptionError, match=r"exporter=3 is not allowed"):
        config.with_repaired_core({"exporter": 3})


class BranchesOnLength(nn.Module):
    """A branch on an input's size, which torch.export turns into a range for that size (9 or more here)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.emb(ids))
        if ids.shape[1] > 8:
            return h.mean()
        return h.sum()


def test_a_graph_serves_only_the_sizes_it_was_exported_for():
    """A call whose sizes fall outside the graph's ranges gets a graph of its own instead of running the branch
    traced for other sizes; each graph then serves its side. Loss and gradients equal PyTorch's (rtol 1e-5, atol
    1e-6) on both sides of the branch."""
    from ortcore.graph import INPUT_RANGES_METADATA, input_ranges

    torch.manual_seed(0)
    reference = BranchesOnLength()
    model = ORTModule(
        copy.deepcopy(reference), host=dynamo_host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE"
    )
    exports = []
    for step, length in enumerate([12, 5, 16, 3, 9, 8]):
        ids = torch.randint(0, 10, (3, length), generator=torch.Generator().manual_seed(step))
        loss, expected = model(ids), reference(ids)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=f"length {length}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"length {length}: {name}")
            p.grad = q.grad = None
        exports.append(model.state_machine.counters.exports)
    # 12: the first call's sizes; 5: a graph dynamic in the length, valid for short ones; 16: outside its ranges
    assert exports == [1, 2, 3, 3, 3, 3]
    graphs = [g.model for g in model.state_machine._graphs.values()]
    assert all(any(p.key == INPUT_RANGES_METADATA for p in g.metadata_props) for g in graphs)
    # the first call's graph serves its sizes only; the ones dynamic in the length (the batch stays 3) each side of
    # the branch
    assert sorted(input_ranges(g)["ids"] for g in graphs) == [
        [(0, 3, 3), (1, 0, 8)],
        [(0, 3, 3), (1, 9, None)],
        [(0, 3, 3), (1, 12, 12)],
    ]


def test_range_violations_name_the_input_dimension_and_bound():
    from ortcore.graph import INPUT_RANGES_METADATA, input_ranges, range_violations
    from ortcore.state import describe_violation

    model = onnx.ModelProto()
    model.metadata_props.add(key=INPUT_RANGES_METADATA, value='{"ids": [[1, 9, null]], "x": [[1, 4, 4]]}')
    ids, x = torch.zeros(2, 5), torch.zeros(2, 4)
    assert range_violations(input_ranges(model), ["ids", "x"], [torch.zeros(2, 9), x]) == ()
    found = range_violations(input_ranges(model), ["ids", "x"], [ids, torch.zeros(2, 6)])
    assert found == (("ids", 1, "below", 9, None), ("x", 1, "above", 4, 4))
    assert [describe_violation(v) for v in found] == ["ids dimension 1 below 9", "x dimension 1 is not 4"]


@torch.library.custom_op("thirdparty_seam::halved", mutates_args=())
def _halved(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


_halved.register_fake(lambda x: torch.empty_like(x))
_halved.register_autograd(lambda ctx, grad: grad * 0.5)


class UsesHalved(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(torch.ops.thirdparty_seam.halved(self.fc(x)), y)


class HalvedPlugin:
    def __init__(self):
        self.translated = 0

    @hookimpl
    def ortcore_export_translations(self, config):
        from onnxscript import opset18 as op

        def halved(x):
            self.translated += 1
            return op.Mul(x, op.CastLike(op.Constant(value_float=0.5), x))

        return {torch.ops.thirdparty_seam.halved.default: halved}


def test_a_third_party_translation_is_used_with_every_built_in_plugin():
    """An op with no kernel ONNX knows, translated by a third-party plugin, is written by that plugin's function:
    op routing (which runs ops without a translation on PyTorch's kernel) sees the plugin's translation and leaves
    the op alone. Loss and gradients equal PyTorch's (rtol 1e-5, atol 1e-6)."""
    from ortcore.host import builtin_plugins

    torch.manual_seed(0)
    reference = UsesHalved()
    halved = HalvedPlugin()
    plugins = {name: importlib.import_module(f"ortcore_plugins.{name}") for name in builtin_plugins()}
    host = make_host({**plugins, "halved": halved})
    model = ORTModule(copy.deepcopy(reference), host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    x, y = batch(5, 0)
    loss, expected = model(x, y), reference(x, y)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert halved.translated == 1
    graph = next(iter(model.state_machine._graphs.values())).model.graph
    operators = [a.s.decode() for n in graph.node if n.op_type == "ATen" for a in n.attribute if a.name == "operator"]
    assert not [o for o in operators if "halved" in o], f"the plugin's op was routed to PyTorch instead: {operators}"


class NllLossForward(nn.Module):
    """``aten.nll_loss_forward`` itself, both outputs (as AOTAutograd's forward graphs call it and pass the total
    weight to the backward's ``nll_loss_backward``)."""

    def __init__(self, reduction: int, ignore_index: int, weighted: bool):
        super().__init__()
        self.reduction, self.ignore_index = reduction, ignore_index
        self.register_buffer("weight", torch.tensor([0.5, 2.0, 1.5]) if weighted else None)

    def forward(self, log_probs: torch.Tensor, target: torch.Tensor):
        return torch.ops.aten.nll_loss_forward.default(log_probs, target, self.weight, self.reduction, self.ignore_index)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
def test_nll_loss_forward_gives_torchs_total_weight(reduction: int, weighted: bool):
    """onnxscript's translation returns the loss's element count as the total weight; the route's own gives torch's
    (targets not ignored, or their weights' sum)."""
    pytest.importorskip("onnxscript")
    model = NllLossForward(reduction, ignore_index=1, weighted=weighted)
    log_probs = torch.log_softmax(torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), dim=1)
    target = torch.tensor([0, 1, 2, 2, 1, 0])  # two ignored
    wrapped = ORTModule(model, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    with torch.no_grad():
        (loss, total), (expected_loss, expected_total) = wrapped(log_probs, target), model(log_probs, target)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=1e-6)
