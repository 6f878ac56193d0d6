"""export_cache: hits skip the exporter (in this process and in a new one), everything that shapes a graph misses,
entries are data only (a pickle is never run), damaged entries are rebuilt with a warning, a directory other users
can write is refused unless trusted, writes are atomic, options are validated.

Whether the exporter ran is observed with a spy exporter (``ORTModule(..., exporter=spy)``): on a hit the state
machine still counts an export transition, but the spy is never called.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import onnx
import pytest
import torch
import torch.utils._pytree as pytree

import ortcore_plugins.export_cache as plugin
from ortcore import ORTModule, identity
from ortcore.config import option
from ortcore.errors import OptionError
from ortcore.graph import ExportedGraph
from ortcore.graph_passes import GraphPass
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginHost
from ortcore.schema import OutputSchema, flatten_outputs
from ortcore.testing import assert_matches_torch, make_host
from ortcore_plugins.torchscript_exporter import TorchScriptExporter

# -- helpers ------------------------------------------------------------------------------------------------------


class SpyExporter(TorchScriptExporter):
    """The default exporter (same name, so the same fingerprint) that counts its calls."""

    def __init__(self, symbolics: dict[str, Any] | None = None):
        super().__init__(symbolics)
        self.calls = 0

    def export(self, *args: Any, **kwargs: Any):
        self.calls += 1
        return super().export(*args, **kwargs)


class FingerprintRecorder:
    """Records every fingerprint the core computes; answers nothing, so the model is exported."""

    def __init__(self):
        self.fingerprints: list[str] = []

    @hookimpl
    def ortcore_load_export(self, fingerprint: str) -> None:
        self.fingerprints.append(fingerprint)


def cache_host(directory: Path | str | None, *, table: dict | None = None, extra: dict | None = None) -> PluginHost:
    env = {"ORTMODULE_CACHE_DIR": str(directory)} if directory is not None else {}
    return make_host({"export_cache": plugin, **(extra or {})}, table=table, env=env)


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def bn_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def run(model: torch.nn.Module, host: PluginHost, args: tuple, **kwargs: Any) -> tuple[ORTModule, SpyExporter]:
    """One forward and backward, compared with PyTorch (outputs, loss, every gradient); returns the spy."""
    spy = kwargs.pop("exporter", None) or SpyExporter()
    wrapped = assert_matches_torch(model, args, host=host, exporter=spy, **kwargs)
    return wrapped, spy


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{plugin.ENTRY_SUFFIX}"))


@pytest.fixture
def cache_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="ortcore.export_cache")
    return caplog


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


# -- hits -----------------------------------------------------------------------------------------------------------


def test_fresh_ortmodule_in_the_same_process_loads_instead_of_exporting(tmp_path, cache_log):
    host = cache_host(tmp_path)
    first, spy = run(mlp(), host, (X,))
    assert spy.calls == 1 and len(entries(tmp_path)) == 1
    fingerprint = entries(tmp_path)[0].name.split(".")[0]
    assert f"export cache miss {fingerprint[:12]}" in cache_log.text

    second, spy = run(mlp(seed=1), host, (X,))  # other weights: entries hold no weights, only the graph
    assert spy.calls == 0, "a hit must not call the exporter"
    assert second.state_machine.counters.exports == 1  # the state machine still records its export transition
    assert (first.state_machine.counters.cache_loads, second.state_machine.counters.cache_loads) == (0, 1)
    assert f"export cache hit {fingerprint[:12]}" in cache_log.text
    assert len(entries(tmp_path)) == 1


def test_batch_norm_model_hits_and_keeps_updating_running_statistics(tmp_path):
    host = cache_host(tmp_path)
    run(bn_model(), host, (X,))
    model = bn_model()
    reference = copy.deepcopy(model)
    wrapped, spy = run(model, host, (X,))
    assert spy.calls == 0
    reference(X)
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)


def test_no_directory_means_no_cache(tmp_path):
    host = cache_host(None)
    run(mlp(), host, (X,))
    _, spy = run(mlp(), host, (X,))
    assert spy.calls == 1
    assert list(tmp_path.iterdir()) == []


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        return Prediction(self.lin(x), x.tanh())


def test_output_types_registered_during_export_are_registered_on_a_hit(tmp_path):
    """ortcore registers a dataclass output with pytree when it first flattens one, during export; a process that
    loads the graph instead never flattens one, so the plugin registers it (as a fresh process would need)."""

    def step() -> tuple[Prediction, Prediction, int]:
        model, spy = DataclassOutput(), SpyExporter()
        expected = copy.deepcopy(model)(X)
        return ORTModule(model, host=cache_host(tmp_path), exporter=spy)(X), expected, spy.calls

    assert step()[2] == 1
    pytree._deregister_pytree_node(Prediction)  # as in a new process
    actual, expected, calls = step()
    assert calls == 0 and isinstance(actual, Prediction)
    torch.testing.assert_close(vars(actual), vars(expected))


def test_core_from_bytes_restores_output_types_in_a_new_process():
    graphs = []

    class Keep:
        @hookimpl
        def ortcore_export_done(self, graph):
            graphs.append(graph)

    model = DataclassOutput()
    ORTModule(model, host=make_host({"keep": Keep()}))(X)
    pytree._deregister_pytree_node(Prediction)  # as in a new process
    graph = ExportedGraph.from_bytes(graphs[0].to_bytes(), model)
    graph.output_schema.restore([torch.zeros(3, 2), torch.zeros(3, 4)])


_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from ortcore import ORTModule, identity
    from ortcore_plugins.torchscript_exporter import TorchScriptExporter
    from ortcore.testing import make_host
    import ortcore_plugins.export_cache as plugin

    class Spy(TorchScriptExporter):
        calls = 0
        def export(self, *args, **kwargs):
            Spy.calls += 1
            return super().export(*args, **kwargs)

    cache_dir, inputs, result = sys.argv[1:4]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    host = make_host({"export_cache": plugin}, env={"ORTMODULE_CACHE_DIR": cache_dir, "ORTMODULE_LOG_LEVEL": "INFO"})
    wrapped = ORTModule(model, host=host, exporter=Spy())
    y = wrapped(torch.load(inputs))
    y.square().mean().backward()
    torch.save(
        {
            "calls": Spy.calls,
            "exports": wrapped.state_machine.counters.exports,
            "y": y.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "running_mean": model[1].running_mean,
        },
        result,
    )
    """
)


def test_second_process_skips_export_and_matches_torch(tmp_path):
    cache = tmp_path / "cache"
    model = bn_model()
    reference = copy.deepcopy(model)
    _, spy = run(model, cache_host(cache), (X,))  # this process exports and stores
    assert spy.calls == 1 and len(entries(cache)) == 1

    script, inputs, result = tmp_path / "child.py", tmp_path / "x.pt", tmp_path / "result.pt"
    script.write_text(_CHILD)
    torch.save(X, inputs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    proc = subprocess.run(
        [sys.executable, str(script), str(cache), str(inputs), str(result)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "export cache hit" in proc.stderr, proc.stderr
    assert "ORT's optimized session graph" in proc.stderr, "the second process loads ORT's optimized graph too"
    child = torch.load(result)
    assert child["calls"] == 0, "the second process must not export"
    assert child["exports"] == 1

    expected = reference(X)
    expected.square().mean().backward()
    torch.testing.assert_close(child["y"], expected.detach(), rtol=1e-4, atol=1e-5)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(child["grads"][name], param.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(child["running_mean"], reference[1].running_mean)


# -- entries are data only -----------------------------------------------------------------------------------------


def test_an_entry_is_a_json_line_and_onnx_bytes(tmp_path):
    run(bn_model(), cache_host(tmp_path), (X,))
    [path] = entries(tmp_path)
    payload, _ = plugin.decode_entry(path.read_bytes(), fingerprint=_header(path)["fingerprint"], rank=0)
    line, _, model_bytes = payload.partition(b"\n")
    state = json.loads(line)
    assert state["batch_norms"][0]["module"] == "1" and state["training"] is True
    assert {i.name for i in onnx.load_model_from_string(model_bytes).graph.input} >= {"input", "0.weight"}


class Weird(enum.Enum):
    A = 1


def test_output_schema_survives_json_with_its_structure_and_constants():
    outputs = {
        "pair": (torch.ones(2), None),
        "list": [torch.zeros(1), 3, 2.5, float("nan"), "text", True],
        "meta": (torch.float16, torch.device("cpu"), Weird.A),
        "prediction": Prediction(torch.ones(3), torch.zeros(3)),
    }
    schema, tensors = flatten_outputs(outputs)
    loaded = OutputSchema.from_json(json.loads(json.dumps(schema.to_json())))
    assert loaded.spec == schema.spec and loaded.names == schema.names
    restored = loaded.restore(tensors)
    assert restored["meta"] == (torch.float16, torch.device("cpu"), Weird.A)
    assert restored["list"][1:3] == [3, 2.5] and restored["list"][4:] == ["text", True]
    assert isinstance(restored["list"][1], int) and isinstance(restored["prediction"], Prediction)


def test_a_graph_whose_output_type_cannot_be_found_by_name_is_not_cached(tmp_path, cache_log):
    @dataclasses.dataclass
    class Local:  # defined in a function: no import path leads back to it, and it is never pickled instead
        y: torch.Tensor

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return Local(self.lin(x))

    for _ in range(2):
        spy = SpyExporter()
        model = Model()
        expected = copy.deepcopy(model)(X)
        torch.testing.assert_close(ORTModule(model, host=cache_host(tmp_path), exporter=spy)(X).y, expected.y)
        assert spy.calls == 1
    assert entries(tmp_path) == []  # ORT's optimized session graph is data, and cached
    [record] = {r.getMessage() for r in cache_log.records if "not cached" in r.getMessage()}
    assert "Local" in record and "import path" in record
    assert all(r.levelno == logging.INFO for r in cache_log.records if "not cached" in r.getMessage())


# -- who may write the directory ------------------------------------------------------------------------------------


def _refused(cache_log: pytest.LogCaptureFixture, directory: Path) -> list[str]:
    return [
        r.getMessage()
        for r in cache_log.records
        if r.levelno == logging.WARNING and f"not using {directory}" in r.getMessage()
    ]


@pytest.mark.parametrize("mode, who", [(0o770, "its group"), (0o757, "all users"), (0o777, "its group and all users")])
def test_a_directory_others_can_write_is_refused_naming_it_and_the_opt_in(tmp_path, cache_log, mode, who):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    for _ in range(2):
        _, spy = run(mlp(), cache_host(shared), (X,))
        assert spy.calls == 1
    assert list(shared.iterdir()) == []  # neither read nor written
    [warning] = _refused(cache_log, shared)  # once per process, not at every export
    assert who in warning and "ORTCORE_EXPORT_CACHE_TRUST_SHARED=1" in warning and "trust_shared" in warning


def test_a_sticky_world_writable_directory_of_this_user_is_used(tmp_path, cache_log):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others may add files, but not replace or remove this user's
    run(mlp(), cache_host(sticky), (X,))
    _, spy = run(mlp(), cache_host(sticky), (X,))
    assert spy.calls == 0 and _refused(cache_log, sticky) == []


def test_a_directory_of_another_user_is_refused(tmp_path, cache_log, monkeypatch):
    owner = os.stat(tmp_path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # as if this process ran as another user
    _, spy = run(mlp(), cache_host(tmp_path), (X,))
    assert spy.calls == 1 and list(tmp_path.iterdir()) == []
    [warning] = _refused(cache_log, tmp_path)
    assert "owned by another user" in warning


def test_trust_shared_opts_in_to_a_shared_directory(tmp_path, cache_log):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    table = {"plugins": {"export_cache": {"trust_shared": True}}}
    run(mlp(), cache_host(shared, table=table), (X,))
    host = make_host(
        {"export_cache": plugin}, env={"ORTMODULE_CACHE_DIR": str(shared), "ORTCORE_EXPORT_CACHE_TRUST_SHARED": "1"}
    )
    _, spy = run(mlp(), host, (X,))
    assert spy.calls == 0 and _refused(cache_log, shared) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_entry_owned_by_another_user_is_ignored_unless_trusted(tmp_path, cache_log):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    run(mlp(), cache_host(sticky), (X,))
    [path] = entries(sticky)
    os.chown(path, 12345, -1)  # planted by another user of the sticky directory
    _, spy = run(mlp(), cache_host(sticky), (X,))
    assert spy.calls == 1 and path.exists()
    assert any("owned by another user" in m and str(path) in m for m in cache_log.messages)
    _, spy = run(mlp(), cache_host(sticky, table={"plugins": {"export_cache": {"trust_shared": True}}}), (X,))
    assert spy.calls == 0


def test_a_directory_the_cache_creates_is_private(tmp_path):
    run(mlp(), cache_host(tmp_path / "new"), (X,))
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700


# -- everything that shapes a graph misses -------------------------------------------------------------------------


class HiddenRepr(torch.nn.Module):
    """Prints the same whatever its size: the printed form alone (upstream's key) would serve a stale graph."""

    def __init__(self, hidden: int):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))

    def forward(self, x):
        return self.body(x)

    def __repr__(self) -> str:
        return "HiddenRepr()"


class Scaled(torch.nn.Module):
    """A plain float attribute that ``repr`` hides and the tracer bakes into the graph as a constant."""

    def __init__(self, scale: float):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale


class Offset(torch.nn.Module):
    """A tensor kept as a plain attribute (not a buffer): the tracer bakes its values in as a constant."""

    def __init__(self, offset: list[float]):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.offset = torch.tensor(offset)

    def forward(self, x):
        return self.lin(x) + self.offset


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, ids):
        return self.lin(self.emb(ids))


@attrs.frozen
class TagOptions:
    tag: str = option("a", lambda v, s: str(v), "written into the graph's doc string")


class TagPlugin:
    """A plugin whose option changes the graph (a pass writes it into the graph) and says so in its export key."""

    @hookimpl
    def ortcore_options_class(self):
        return TagOptions

    @hookimpl
    def ortcore_graph_passes(self, config):
        tag = config.plugin_options("tag").tag

        def write_tag(model, context):
            model.graph.doc_string = f"tag={tag}"

        return [GraphPass("write_tag", run=write_tag)]

    @hookimpl
    def ortcore_export_key(self, config):
        return {"tag": config.plugin_options("tag").tag}


def _train_with_frozen_bn(model: torch.nn.Module) -> torch.nn.Module:
    model.train()
    model[1].eval()  # a frozen batch norm inside a training model: the graph uses running statistics
    return model


def _with_hook(model: torch.nn.Module) -> torch.nn.Module:
    model[0].register_forward_hook(lambda module, args, output: output * 2.0)
    return model


def _eval(model: torch.nn.Module) -> torch.nn.Module:
    return model.eval()


def _freeze_bias(model: torch.nn.Module) -> torch.nn.Module:
    model[0].bias.requires_grad_(False)
    return model


def _toy(factor: float) -> torch.nn.Module:
    """The same class name, printed form and parameters each time; forward's code differs (an edited model file)."""

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x) * factor

    Toy.__qualname__ = "Toy"
    return Toy()


# (first model, first args, second model, second args, ORTModule kwargs of each run, table of each run)
Case = tuple[Callable[[], torch.nn.Module], tuple, Callable[[], torch.nn.Module], tuple, tuple[dict, dict], tuple]
MISSES: dict[str, Case] = {
    "input dtype": (
        Embed,
        (torch.tensor([[1, 2], [3, 4]]),),
        Embed,
        (torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),),
        ({}, {}),
        (None, None),
    ),
    "input rank": (mlp, (X,), mlp, (torch.randn(2, 3, 4),), ({}, {}), (None, None)),
    "train vs eval": (bn_model, (X,), lambda: _eval(bn_model()), (X,), ({}, {}), (None, None)),
    "requires_grad flipped": (mlp, (X,), lambda: _freeze_bias(mlp()), (X,), ({}, {}), (None, None)),
    "opset": (mlp, (X,), mlp, (X,), ({"opset": 17}, {"opset": 15}), (None, None)),
    "layer size behind an identical repr": (
        lambda: HiddenRepr(8),
        (X,),
        lambda: HiddenRepr(16),
        (X,),
        ({}, {}),
        (None, None),
    ),
    "plugin option": (
        mlp,
        (X,),
        mlp,
        (X,),
        ({}, {}),
        ({"plugins": {"tag": {"tag": "a"}}}, {"plugins": {"tag": {"tag": "b"}}}),
    ),
    # Below: what the tracer bakes in beyond the module's printed form and state (identity.module_digest).
    "hidden float attribute": (lambda: Scaled(2.0), (X,), lambda: Scaled(3.0), (X,), ({}, {}), (None, None)),
    "tensor kept as a plain attribute": (
        lambda: Offset([1.0, 2.0]),
        (X,),
        lambda: Offset([1.0, 5.0]),
        (X,),
        ({}, {}),
        (None, None),
    ),
    "submodule in eval inside a training model": (
        bn_model,
        (X,),
        lambda: _train_with_frozen_bn(bn_model()),
        (X,),
        ({}, {}),
        (None, None),
    ),
    "forward hook": (mlp, (X,), lambda: _with_hook(mlp()), (X,), ({}, {}), (None, None)),
    "model code": (lambda: _toy(2.0), (X,), lambda: _toy(3.0), (X,), ({}, {}), (None, None)),
}


# The core exports these unlike PyTorch runs them, cache or not (test_frozen_submodule_matches_torch): compare
# exporter calls only.
NO_TORCH_PARITY = {"submodule in eval inside a training model"}


@pytest.mark.parametrize("case", list(MISSES), ids=list(MISSES))
def test_a_change_that_shapes_the_graph_misses(tmp_path, case):
    make_first, first_args, make_second, second_args, (first_kwargs, second_kwargs), (first_table, second_table) = (
        MISSES[case]
    )
    extra = {"tag": TagPlugin()} if case == "plugin option" else None

    def step(make: Callable[[], torch.nn.Module], host: PluginHost, args: tuple, kwargs: dict) -> int:
        if case not in NO_TORCH_PARITY:
            return run(make(), host, args, **kwargs)[1].calls  # outputs and grads checked against torch
        spy = SpyExporter()
        ORTModule(make(), host=host, exporter=spy, **kwargs)(*args).sum().backward()
        return spy.calls

    assert step(make_first, cache_host(tmp_path, table=first_table, extra=extra), first_args, first_kwargs) == 1
    host = cache_host(tmp_path, table=second_table, extra=extra)
    assert step(make_second, host, second_args, second_kwargs) == 1, f"{case}: served another configuration's graph"
    assert len(entries(tmp_path)) == 2
    assert step(make_second, host, second_args, second_kwargs) == 0, f"{case}: its own entry must hit"


def test_changed_model_code_misses(tmp_path, monkeypatch):
    """Same class name, printed form and parameters; only forward's code differs (a model file edited between runs)."""
    source = "import torch\nclass Toy(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(4, 2)\n    def forward(self, x):\n        return self.lin(x) * {k}\n"
    classes = []
    for version, factor in (("v1", 2.0), ("v2", 3.0)):
        path = tmp_path / version / "toy_model.py"
        path.parent.mkdir()
        path.write_text(source.replace("{k}", str(factor)))
        spec = importlib.util.spec_from_file_location("toy_model", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        classes.append(module)
    cache = tmp_path / "cache"
    for module, expected_calls in ((classes[0], 1), (classes[1], 1), (classes[1], 0)):
        monkeypatch.setitem(sys.modules, "toy_model", module)  # as each process would have imported it
        _, spy = run(module.Toy(), cache_host(cache), (X,))
        assert spy.calls == expected_calls


# -- gaps in the core's fingerprint ---------------------------------------------------------------------------------


def _core_fingerprint(model: torch.nn.Module, args: tuple, extra: dict | None = None, **kwargs: Any) -> str:
    recorder = FingerprintRecorder()
    host = make_host({**(extra or {}), "recorder": recorder})
    ORTModule(model, host=host, **kwargs)(*args)
    return recorder.fingerprints[-1]


class ReluAsMax:
    """Contributes a TorchScript symbolic (relu as Max(x, 0)) without an export key."""

    @hookimpl
    def ortcore_export_symbolics(self):
        def relu(g, x):
            return g.op("Max", x, g.op("Constant", value_t=torch.tensor(0.0)))

        return {"::relu": relu}


class WithOnes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x) + torch.ones(2)  # float64 under torch.set_default_dtype(torch.float64): another graph


def _under_float64(model: torch.nn.Module, args: tuple) -> str:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _core_fingerprint(model, args)
    finally:
        torch.set_default_dtype(default)


def _library_versions(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    class Layer(torch.nn.Linear):
        pass

    Layer.__module__ = "fake_library.layers"
    fake = type(sys)("fake_library")
    monkeypatch.setitem(sys.modules, "fake_library", fake)
    fake.__version__ = "1.0"
    first = _core_fingerprint(Layer(4, 2), (X,))
    fake.__version__ = "2.0"  # transformers upgraded, say
    identity._package_version.cache_clear()  # versions are read once per process: this is a new one
    try:
        return first, _core_fingerprint(Layer(4, 2), (X,))
    finally:
        identity._package_version.cache_clear()


# Each returns the core's fingerprints of two setups that export different graphs.
CORE_SEES: dict[str, Callable[[pytest.MonkeyPatch], tuple[str, str]]] = {
    "hidden float attribute": lambda mp: (_core_fingerprint(Scaled(2.0), (X,)), _core_fingerprint(Scaled(3.0), (X,))),
    "tensor kept as a plain attribute": lambda mp: (
        _core_fingerprint(Offset([1.0]), (X,)),
        _core_fingerprint(Offset([5.0]), (X,)),
    ),
    "forward hook": lambda mp: (_core_fingerprint(mlp(), (X,)), _core_fingerprint(_with_hook(mlp()), (X,))),
    "model code": lambda mp: (_core_fingerprint(_toy(2.0), (X,)), _core_fingerprint(_toy(3.0), (X,))),
    "default dtype": lambda mp: (_core_fingerprint(WithOnes(), (X,)), _under_float64(WithOnes(), (X,))),
    "version of the library defining the model": _library_versions,
    "submodule in eval inside a training model": lambda mp: (
        _core_fingerprint(bn_model(), (X,)),
        _core_fingerprint(_train_with_frozen_bn(bn_model()), (X,)),
    ),
    "plugin symbolics without an export key": lambda mp: (
        _core_fingerprint(mlp(), (X,)),
        _core_fingerprint(mlp(), (X,), {"relu_as_max": ReluAsMax()}),
    ),
}


@pytest.mark.parametrize("change", list(CORE_SEES), ids=list(CORE_SEES))
def test_core_fingerprint_sees(change, monkeypatch):
    first, second = CORE_SEES[change](monkeypatch)
    assert first != second


def test_frozen_submodule_matches_torch():
    assert_matches_torch(_train_with_frozen_bn(bn_model()), (X,), host=make_host({}))


def test_plugin_symbolics_without_an_export_key_miss(tmp_path):
    run(mlp(), cache_host(tmp_path), (X,))
    _, spy = run(mlp(), cache_host(tmp_path, extra={"relu_as_max": ReluAsMax()}), (X,))
    assert spy.calls == 1  # the core's fingerprint names the symbolic serving each op


def test_module_digest_ignores_process_state_that_never_reaches_a_graph():
    model = mlp()
    model.log = logging.getLogger("my.training")  # a logger's state is every logger of the process
    before = identity.module_digest(model)
    logging.getLogger("my.training.other").setLevel(logging.DEBUG)
    assert identity.module_digest(model) == before


def test_module_digest_of_an_attribute_it_cannot_describe_never_repeats(caplog):
    class Opaque:
        __slots__ = ()

        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    model = mlp()
    model.thing = Opaque()
    caplog.set_level(logging.INFO, logger="ortcore")
    assert identity.module_digest(model) != identity.module_digest(model)  # so no cache ever serves its graph
    assert "cannot describe" in caplog.text and "Opaque" in caplog.text


def test_module_digest_is_stable_and_sees_default_dtype_and_package_version(monkeypatch):
    a, b = mlp(), mlp(seed=3)
    handle = b[0].register_forward_hook(lambda *args: None)  # hook handle ids advance; removed hooks leave no trace
    handle.remove()
    assert identity.module_digest(a) == identity.module_digest(b)  # weights are not part of it

    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)  # torch.ones(...) inside forward becomes float64 in the graph
        f64 = identity.module_digest(a)
    finally:
        torch.set_default_dtype(default)
    assert f64 != identity.module_digest(a)

    class Library(torch.nn.Linear):
        pass

    Library.__module__ = "fake_library.layers"
    fake = type(sys)("fake_library")
    fake.__version__ = "1.0"
    monkeypatch.setitem(sys.modules, "fake_library", fake)
    identity._package_version.cache_clear()
    before = identity.module_digest(Library(2, 2))
    fake.__version__ = "2.0"  # a library upgrade: same classes, other code
    identity._package_version.cache_clear()
    assert identity.module_digest(Library(2, 2)) != before
    identity._package_version.cache_clear()


# -- damaged entries are rebuilt ------------------------------------------------------------------------------------


def _header(path: Path) -> dict:
    return json.loads(path.read_bytes().split(b"\n", 2)[1])


def _rewrap(path: Path, payload: bytes) -> bytes:
    """An entry with a valid header and checksum for ``path``'s key around ``payload``."""
    h = _header(path)
    return plugin.encode_entry(payload, fingerprint=h["fingerprint"], rank=h["rank"])


def _foreign_bn_payload(tmp_path: Path) -> bytes:
    """The payload of a batch-norm model's entry (for a model that has no such module)."""
    other = tmp_path / "other"
    run(bn_model(), cache_host(other), (X,))
    [path] = entries(other)
    h = _header(path)
    payload, _ = plugin.decode_entry(path.read_bytes(), fingerprint=h["fingerprint"], rank=0)
    return payload


def _foreign_inputs_payload(tmp_path: Path) -> bytes:
    """The payload of another model without batch norm: its graph reads parameters this model does not have."""
    other = tmp_path / "other"
    torch.manual_seed(0)
    run(
        torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity(), torch.nn.Linear(4, 2)),
        cache_host(other),
        (X,),
    )
    [path] = entries(other)
    h = _header(path)
    payload, _ = plugin.decode_entry(path.read_bytes(), fingerprint=h["fingerprint"], rank=0)
    return payload


# Set by the payload of _Planted if anything ever unpickles it: entries are data, never code to run.
PLANTED_RAN: list[str] = []


def _planted_ran(tag: str) -> None:
    PLANTED_RAN.append(tag)


class _Planted:
    def __reduce__(self):
        return (_planted_ran, ("an entry ran code",))


def _with_graph_json(path: Path, edit: Callable[[dict], None], model: bytes | None = None) -> bytes:
    """The entry at ``path`` with its graph's JSON line edited, or its ONNX bytes replaced (header and checksum made
    valid again)."""
    payload, _ = plugin.decode_entry(path.read_bytes(), fingerprint=_header(path)["fingerprint"], rank=0)
    line, _, onnx_bytes = payload.partition(b"\n")
    state = json.loads(line)
    edit(state)
    return _rewrap(path, json.dumps(state).encode() + b"\n" + (onnx_bytes if model is None else model))


def _old_pickle_entry(path: Path) -> bytes:
    """An entry of format 1 (a pickle payload), as earlier versions wrote, at the same path."""
    payload = pickle.dumps(_Planted())
    header = {"fingerprint": _header(path)["fingerprint"], "rank": 0, "graph_format": 1, "size": len(payload)}
    header["sha256"] = hashlib.sha256(payload).hexdigest()
    return b"%s 1\n%s\n%s" % (plugin.MAGIC, json.dumps(header).encode(), payload)


CORRUPTIONS: dict[str, Callable[[Path, Path], bytes]] = {
    "empty file": lambda path, tmp: b"",
    "truncated": lambda path, tmp: path.read_bytes()[: len(path.read_bytes()) // 2],
    "truncated inside the header": lambda path, tmp: path.read_bytes()[:40],
    "garbage bytes": lambda path, tmp: os.urandom(4096),
    "one payload byte flipped": lambda path, tmp: (lambda d: d[:-10] + bytes([d[-10] ^ 0xFF]) + d[-9:])(
        path.read_bytes()
    ),
    "bare pickle without header": lambda path, tmp: pickle.dumps(_Planted()),
    "pickle with a valid header": lambda path, tmp: _rewrap(path, pickle.dumps(_Planted())),
    "entry of the old pickle format": lambda path, tmp: _old_pickle_entry(path),
    "graph JSON of another format": lambda path, tmp: _with_graph_json(path, lambda s: s.update(format=999)),
    "graph JSON garbled": lambda path, tmp: _rewrap(path, b"{not json\n" + b"\x08\x07"),
    "graph JSON with a wrong field type": lambda path, tmp: _with_graph_json(path, lambda s: s.update(input_names=3)),
    "graph JSON naming an output type never imported": lambda path, tmp: _with_graph_json(
        path,
        lambda s: s["output_schema"].update(spec={"type": "no_such_module:T", "context": {"v": None}, "children": []}),
    ),
    "ONNX bytes that do not parse": lambda path, tmp: _with_graph_json(path, lambda s: None, b"\xff" * 7),
    "entry of another fingerprint": lambda path, tmp: plugin.encode_entry(b"x", fingerprint="0" * 64, rank=0),
    "another entry format": lambda path, tmp: path.read_bytes().replace(b"CACHE 2\n", b"CACHE 7\n", 1),
    "another model's batch norms": lambda path, tmp: _rewrap(path, _foreign_bn_payload(tmp)),
    "another model's parameters": lambda path, tmp: _rewrap(path, _foreign_inputs_payload(tmp)),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_damaged_entry_is_logged_removed_and_rebuilt(tmp_path, cache_log, corruption):
    cache = tmp_path / "cache"
    run(mlp(), cache_host(cache), (X,))
    [path] = entries(cache)
    path.write_bytes(CORRUPTIONS[corruption](path, tmp_path))
    cache_log.clear()

    _, spy = run(mlp(), cache_host(cache), (X,))  # never crashes, never a wrong graph (checked against torch)
    assert spy.calls == 1
    assert PLANTED_RAN == [], "an entry's payload ran code"
    warnings = [r for r in cache_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage() and "removed" in warnings[0].getMessage()

    assert entries(cache) == [path]  # rebuilt in place, and valid again:
    _, spy = run(mlp(), cache_host(cache), (X,))
    assert spy.calls == 0


def test_unreadable_entry_warns_and_exports(tmp_path, cache_log, monkeypatch):
    run(mlp(), cache_host(tmp_path), (X,))
    [path] = entries(tmp_path)
    path.unlink()
    path.mkdir()  # open() raises IsADirectoryError: not a damaged entry we may delete, just unusable
    _, spy = run(mlp(), cache_host(tmp_path), (X,))
    assert spy.calls == 1
    assert any(
        "cannot" in r.getMessage() and str(path) in r.getMessage()
        for r in cache_log.records
        if r.levelno == logging.WARNING
    )


# -- writes ---------------------------------------------------------------------------------------------------------


def test_writes_leave_no_temporary_files_and_nothing_but_entries(tmp_path):
    host = cache_host(tmp_path)
    run(mlp(), host, (X,))
    run(mlp(), host, (torch.randn(2, 3, 4),))
    run(_eval(mlp()), host, (X,))
    kept = entries(tmp_path) + sessions(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)
    assert len(entries(tmp_path)) == 3
    assert len(sessions(tmp_path)) >= 2  # the training graph and the eval graph's (graphs alike share one)


def test_a_failed_write_warns_names_the_path_and_leaves_nothing(tmp_path, cache_log, monkeypatch):
    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plugin.os, "replace", failing_replace)
    _, spy = run(mlp(), cache_host(tmp_path), (X,))  # training goes on
    monkeypatch.undo()
    assert spy.calls == 1
    assert list(tmp_path.iterdir()) == []
    warnings = [r.getMessage() for r in cache_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # the exported graph and ORT's optimized session graph
    assert all(str(tmp_path) in warning and "No space left" in warning for warning in warnings)


def test_concurrent_writers_and_readers_only_ever_see_whole_entries(tmp_path):
    graphs = []

    class Keep:
        @hookimpl
        def ortcore_export_done(self, fingerprint, graph):
            graphs.append((fingerprint, graph))

    model = mlp()
    run(model, make_host({"keep": Keep()}), (X,))
    fingerprint, graph = graphs[0]
    cache = plugin.ExportCache(str(tmp_path))
    path = cache.entry_path(fingerprint, 0)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(15):
                cache.store(fingerprint, 0, graph)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    def read() -> None:
        try:
            for _ in range(60):
                if os.path.exists(path):
                    plugin.decode_entry(Path(path).read_bytes(), fingerprint=fingerprint, rank=0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]
    assert cache.load(mlp(), fingerprint, 0) is not None


def test_each_rank_has_its_own_entries(tmp_path, monkeypatch):
    run(mlp(), cache_host(tmp_path), (X,))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 3)
    _, spy = run(mlp(), cache_host(tmp_path), (X,))
    assert spy.calls == 1  # rank 3 never reads rank 0's entry
    names = sorted(p.name for p in entries(tmp_path))
    assert [n.rsplit(".", 2)[1] for n in names] == ["rank0", "rank3"]
    _, spy = run(mlp(), cache_host(tmp_path), (X,))
    assert spy.calls == 0


# -- eviction -------------------------------------------------------------------------------------------------------


def test_least_recently_used_entries_are_evicted_beyond_max_entries(tmp_path):
    host = cache_host(tmp_path, table={"plugins": {"export_cache": {"max_entries": 2}}})
    shapes = [(X,), (torch.randn(2, 3, 4),), (torch.randn(2, 2, 3, 4),)]
    paths = []
    for i, args in enumerate(shapes[:2]):
        run(mlp(), host, args)
        [new] = set(entries(tmp_path)) - set(paths)
        os.utime(new, ns=(10**18 + i, 10**18 + i))  # a deterministic age order
        paths.append(new)
    _, spy = run(mlp(), host, shapes[0])  # a hit makes the first entry the most recently used
    assert spy.calls == 0
    run(mlp(), host, shapes[2])
    remaining = entries(tmp_path)
    assert len(remaining) == 2 and paths[0] in remaining and paths[1] not in remaining


def test_max_bytes_keeps_at_least_the_newest_entry(tmp_path):
    host = cache_host(tmp_path, table={"plugins": {"export_cache": {"max_bytes": "1"}}})
    run(mlp(), host, (X,))
    run(mlp(), host, (torch.randn(2, 3, 4),))
    assert len(entries(tmp_path)) == 1


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path):
    stale = tmp_path / ".abc.ortgraph.123.tmp"
    fresh = tmp_path / ".def.ortgraph.456.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (1, 1))
    plugin.ExportCache(str(tmp_path)).evict()
    assert not stale.exists() and fresh.exists()  # a live writer's file is left alone


# -- options --------------------------------------------------------------------------------------------------------


def test_directory_from_toml_is_made_absolute_and_created_at_first_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    host = make_host({"export_cache": plugin}, table={"plugins": {"export_cache": {"dir": "cache/graphs"}}})
    assert host.config.plugin_options("export_cache").dir == str(tmp_path / "cache" / "graphs")
    assert not (tmp_path / "cache").exists()  # configuration creates nothing
    run(mlp(), host, (X,))
    assert len(entries(tmp_path / "cache" / "graphs")) == 1


def test_environment_overrides_toml(tmp_path):
    host = make_host(
        {"export_cache": plugin},
        table={"plugins": {"export_cache": {"dir": str(tmp_path / "toml")}}},
        env={"ORTMODULE_CACHE_DIR": str(tmp_path / "env"), "ORTCORE_EXPORT_CACHE_MAX_ENTRIES": "3"},
    )
    options = host.config.plugin_options("export_cache")
    assert (options.dir, options.max_entries) == (str(tmp_path / "env"), 3)


@pytest.mark.parametrize(
    "make_dir, message",
    [
        (lambda tmp: tmp / "a_file", "is not a directory"),
        (lambda tmp: tmp / "a_file" / "sub", "cannot be created: .* is not a directory"),
    ],
    ids=["a file", "below a file"],
)
def test_invalid_directory_is_an_option_error_naming_the_path(tmp_path, make_dir, message):
    (tmp_path / "a_file").write_text("")
    bad = make_dir(tmp_path)
    with pytest.raises(OptionError, match=rf"ORTMODULE_CACHE_DIR=.*{bad}.*{message}"):
        cache_host(bad)
    with pytest.raises(OptionError, match=rf"plugins.export_cache.dir=.*{message}"):
        make_host({"export_cache": plugin}, table={"plugins": {"export_cache": {"dir": str(bad)}}})


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_directory_is_an_option_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OptionError, match="is not writable"):
        cache_host(locked)


@pytest.mark.parametrize(
    "key, value",
    [("max_entries", -1), ("max_entries", "many"), ("max_entries", True), ("max_bytes", "2 parsecs"), ("dir", 3)],
)
def test_bad_option_values_are_option_errors(tmp_path, key, value):
    with pytest.raises(OptionError, match=rf"plugins.export_cache.{key}="):
        make_host({"export_cache": plugin}, table={"plugins": {"export_cache": {key: value}}})


def test_sizes_accept_binary_units():
    assert plugin._parse_size("2GiB", "x") == 2 << 30
    assert plugin._parse_size("500m", "x") == 500 << 20
    assert plugin._parse_size(1024, "x") == 1024
    assert plugin._parse_size("0", "x") == 0


def test_entry_header_checks_every_field():
    payload = b"payload"
    data = plugin.encode_entry(payload, fingerprint="a" * 64, rank=1, export_seconds=1.5)
    got, header = plugin.decode_entry(data, fingerprint="a" * 64, rank=1)
    assert got == payload and header["export_seconds"] == 1.5
    assert header["sha256"] == hashlib.sha256(payload).hexdigest()
    for field, kwargs in {
        "fingerprint": {"fingerprint": "b" * 64, "rank": 1},
        "rank": {"fingerprint": "a" * 64, "rank": 0},
    }.items():
        with pytest.raises(plugin.EntryError, match=field):
            plugin.decode_entry(data, **kwargs)


# -- Hugging Face ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_gpt2_second_process_hits_and_attention_implementation_misses(tmp_path):
    """The digest of a transformers model is the same in every process, and sees its config's attention choice."""
    transformers = pytest.importorskip("transformers")
    script = tmp_path / "gpt2.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch, transformers
            from ortcore import ORTModule, identity
            from ortcore_plugins.torchscript_exporter import TorchScriptExporter
            from ortcore.testing import make_host
            import ortcore_plugins.export_cache as plugin

            class Spy(TorchScriptExporter):
                calls = 0
                def export(self, *args, **kwargs):
                    Spy.calls += 1
                    return super().export(*args, **kwargs)

            config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
            config._attn_implementation = sys.argv[2]
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(config)
            # The audit off: with GPT-2's dropout it exports a dropout-off variant of its own (never cached).
            env = {"ORTMODULE_CACHE_DIR": sys.argv[1], "ORTCORE_VERIFY_GRADIENTS": "0"}
            host = make_host({"export_cache": plugin}, env=env)
            ids = torch.randint(0, 64, (2, 8))
            ORTModule(model, host=host, exporter=Spy())(input_ids=ids, labels=ids).loss.backward()
            print(Spy.calls)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}

    def calls(attention: str) -> int:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "cache"), attention],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    assert transformers is not None
    assert [calls("eager"), calls("eager"), calls("sdpa")] == [1, 0, 1]


# -- ORT's optimized session graphs ------------------------------------------------------------------------------------


def sessions(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{plugin.SESSION_SUFFIX}"))


def test_the_optimized_session_graph_is_cached_and_a_second_build_loads_it(tmp_path, cache_log):
    host = cache_host(tmp_path)
    run(mlp(), host, (X,))
    assert len(sessions(tmp_path)) == 1, "the first build stores ORT's optimized graph"
    assert not list(tmp_path.glob(".*")), "no temporary file is left behind"
    key = sessions(tmp_path)[0].name.split(".")[0]
    payload, _ = plugin.decode_entry(sessions(tmp_path)[0].read_bytes(), fingerprint=key, rank=0)
    assert any(node.op_type == "YieldOp" for node in onnx.load_model_from_string(payload).graph.node)

    cache_log.clear()
    wrapped, _ = run(mlp(seed=1), host, (X,))  # compared with PyTorch: outputs, loss, every gradient
    assert f"export cache hit {key[:12]} (rank 0): ORT's optimized session graph" in cache_log.text
    assert wrapped.state_machine.counters.builds == 1
    for _ in range(3):  # later steps too
        assert_matches_torch(mlp(seed=2), (X,), host=host)


def test_a_damaged_session_entry_is_removed_and_the_graph_optimized_again(tmp_path, cache_log):
    host = cache_host(tmp_path)
    run(mlp(), host, (X,))
    (entry,) = sessions(tmp_path)
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF
    entry.write_bytes(bytes(data))
    run(mlp(), host, (X,))
    assert "is unusable (EntryError: checksum mismatch" in cache_log.text
    assert len(sessions(tmp_path)) == 1, "stored again after the rebuild"
    plugin.decode_entry(sessions(tmp_path)[0].read_bytes(), fingerprint=entry.name.split(".")[0], rank=0)


def test_a_prepared_graph_ort_refuses_falls_back_to_the_graph(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    host = cache_host(tmp_path)
    run(mlp(), host, (X,))
    (entry,) = sessions(tmp_path)
    key = entry.name.split(".")[0]
    node = onnx.helper.make_node("NoSuchOp", ["x"], ["y"], domain="no.such.domain")
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", 1, [1])], [])
    bogus = onnx.helper.make_model(graph).SerializeToString()
    entry.write_bytes(plugin.encode_entry(bogus, fingerprint=key, rank=0))
    wrapped, _ = run(mlp(), host, (X,))  # still PyTorch's numbers
    assert "ONNX Runtime refused the prepared training graph" in caplog.text
    assert wrapped.state_machine.counters.builds == 2


def test_the_session_key_follows_graph_settings_and_onnxruntime(monkeypatch):
    from types import SimpleNamespace

    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    graph = SimpleNamespace(model=model)
    plan = SimpleNamespace(config_entries={"a": "1"}, execution_order=None, providers=[("CPUExecutionProvider", {})])
    key = plugin.session_key(graph, plan)
    assert plugin.session_key(graph, plan) == key
    assert plugin.session_key(graph, SimpleNamespace(**{**vars(plan), "config_entries": {"a": "2"}})) != key
    assert plugin.session_key(graph, SimpleNamespace(**{**vars(plan), "execution_order": 1})) != key
    other = onnx.helper.make_model(onnx.helper.make_graph([], "h", [], []))
    assert plugin.session_key(SimpleNamespace(model=other), plan) != key
    monkeypatch.setattr(plugin.onnxruntime, "__version__", "0.0.0")
    assert plugin.session_key(graph, plan) != key


def test_save_onnx_still_writes_the_execution_model_when_the_cache_keeps_it(tmp_path, monkeypatch):
    from ortcore import DebugOptions

    out, cache = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    monkeypatch.chdir(out)  # the host's environment is the cache's only: files go to the working directory
    run(mlp(), cache_host(cache), (X,), debug_options=DebugOptions(save_onnx=True, onnx_prefix="m"))
    (entry,) = sessions(cache)
    written = out / "m_execution_model_training.onnx"
    payload, _ = plugin.decode_entry(entry.read_bytes(), fingerprint=entry.name.split(".")[0], rank=0)
    assert written.read_bytes() == payload
