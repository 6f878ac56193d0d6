"""aten_fallback's ``torch_kernels = "auto"``: each op runs where it measured faster, decided once per machine.

The decision logic runs with a fake timer (which side is faster is the timer's say; tests never assert speed); the
cache is checked for a round trip, a corrupt file, its key and a second model that measures nothing; a model trained
with ``auto`` matches eager PyTorch whatever was chosen; the explicit list and ``none`` behave as before. One slow
test measures for real.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from models import (
    adamw,
    assert_grads_match,
    assert_losses_match,
    assert_outputs_match,
    bert_batch,
    hf_step,
    make_batches,
    ort_and_torch,
    tiny_bert,
)
from torch import nn

import ortcore_plugins.aten_fallback as plugin
import ortcore_plugins.export_cache as export_cache
from ortcore import DebugOptions
from ortcore.config import Config
from ortcore.errors import OptionError
from ortcore.host import PluginHost
from ortcore_plugins.aten_fallback import kernel_choice
from ortcore_plugins.aten_fallback.kernel_choice import ORT, PYTORCH, Case, Decision, KernelChooser, choose

# -- helpers ------------------------------------------------------------------------------------------------------


class FakeTimer:
    """``case -> (ort_ms, torch_ms)`` from a table by op (form first), counting the cases it timed."""

    def __init__(self, table: dict[str, tuple[float, float]]):
        self.table = table
        self.cases: list[Case] = []

    def __call__(self, case: Case) -> tuple[float, float]:
        self.cases.append(case)
        return self.table.get(case.form, self.table[case.op]) if case.form else self.table[case.op]


def make_host(
    tmp_path: Path, kernels: Any = "auto", plugins: dict | None = None, env: dict | None = None
) -> PluginHost:
    """A host with this plugin (and ``plugins``); its kernel-choice file lives in ``tmp_path``."""
    table = {"plugins": {"aten_fallback": {"torch_kernels": kernels}}}
    environment = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "ORTCORE_KERNEL_MEASURE": "export", **(env or {})}
    return PluginHost(
        Config.from_table(table, env=environment),
        autoload=False,
        plugins={"aten_fallback": plugin, **(plugins or {})},
    )


@pytest.fixture
def fake_chooser(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Install a chooser with a fake timer as the process-wide one of ``tmp_path``'s hosts."""

    # The machine as the measurements see it: idle unless a test says otherwise (``_Load.pct``), whatever else runs.
    monkeypatch.setattr(kernel_choice, "OthersCPU", _Load)
    monkeypatch.setattr(kernel_choice, "measurement_record", kernel_choice.MeasurementRecord())

    def install(table: dict[str, tuple[float, float]], host: PluginHost) -> tuple[KernelChooser, FakeTimer]:
        timer = FakeTimer(table)
        path = kernel_choice.cache_path(host.config)
        chooser = KernelChooser(path, timer=timer)
        monkeypatch.setitem(kernel_choice._choosers, path, chooser)
        return chooser, timer

    return install


GELU = Case("gelu", ((8, 128, 1024),), params=(("approximate", "none"), ("bias", True)))

# -- the decision -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ort_ms, torch_ms, side",
    [
        (10.0, 4.0, PYTORCH),
        (4.0, 10.0, ORT),
        (10.0, 10.0, ORT),
        (10.0, 9.5, ORT),
        (10.0, 9.1, ORT),
        (10.0, 8.9, PYTORCH),
    ],
)
def test_the_faster_side_is_chosen_and_ties_stay_in_ort(ort_ms: float, torch_ms: float, side: str) -> None:
    assert choose(ort_ms, torch_ms) == side


def test_a_case_is_measured_once_then_cached(tmp_path: Path) -> None:
    timer = FakeTimer({"gelu": (10.0, 3.0)})
    chooser = KernelChooser(tmp_path / "k.json", timer=timer)
    first, again = chooser.decide(GELU), chooser.decide(GELU)
    assert (first.side, first.source, first.ort_ms, first.torch_ms) == (PYTORCH, "measured", 10.0, 3.0)
    assert (again.side, again.source) == (PYTORCH, "cached")
    assert chooser.measurements == 1 and len(timer.cases) == 1


def test_the_file_serves_another_chooser_without_measuring(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "k.json"
    KernelChooser(path, timer=FakeTimer({"gelu": (2.0, 3.0)})).decide(GELU)
    timer = FakeTimer({"gelu": (100.0, 1.0)})  # would choose PyTorch if it were asked
    second = KernelChooser(path, timer=timer)
    decision = second.decide(GELU)
    assert (decision.side, decision.source, decision.ort_ms, decision.torch_ms) == (ORT, "cached", 2.0, 3.0)
    assert timer.cases == [] and second.measurements == 0
    data = json.loads(path.read_text())
    assert data["format"] == kernel_choice.FILE_FORMAT and len(data["entries"]) == 1


class _Load:
    """Stands in for ``OthersCPU``: other processes took ``pct`` percent of the CPU while a case was measured."""

    pct = 0.0

    def stop(self) -> float:
        return self.pct


def test_a_case_measured_under_load_is_provisional_and_measured_again_by_the_next_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernel_choice, "OthersCPU", _Load)
    monkeypatch.setattr(_Load, "pct", 55.0)
    path = tmp_path / "k.json"
    timer = FakeTimer({"gelu": (10.0, 3.0)})
    chooser = KernelChooser(path, timer=timer)
    first, again = chooser.decide(GELU), chooser.decide(GELU)
    assert (first.side, first.source, first.others_pct) == (PYTORCH, "provisional", 55.0)
    assert again.source == "provisional" and len(timer.cases) == 1  # held for this process
    assert (
        "other processes took 55% of the CPU, measured again on a later step or by the next process" in first.reason()
    )
    assert not path.exists()  # nothing written: the next process measures again
    monkeypatch.setattr(_Load, "pct", 2.0)
    later = KernelChooser(path, timer=FakeTimer({"gelu": (3.0, 10.0)}))
    decision = later.decide(GELU)
    assert (decision.side, decision.source, decision.others_pct) == (ORT, "measured", 2.0)
    entry = next(iter(json.loads(path.read_text())["entries"].values()))
    assert entry["others_pct"] == 2.0 and entry["source"] == "measured"


@pytest.mark.parametrize(
    "content", ["{not json", '{"format": 99, "entries": {}}', '{"format": 1, "entries": {"k": 3}}']
)
def test_a_corrupt_file_is_a_warning_and_the_case_is_measured_again(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "k.json"
    path.write_text(content)
    chooser = KernelChooser(path, timer=FakeTimer({"gelu": (10.0, 3.0)}))
    with caplog.at_level(logging.WARNING, logger="ortcore.aten_fallback"):
        decision = chooser.decide(GELU)
    assert decision.source == "measured" and chooser.measurements == 1
    assert "kernel choice cache" in caplog.text
    assert len(json.loads(path.read_text())["entries"]) >= 1  # rewritten as a valid file


def test_the_key_changes_with_shapes_parameters_and_threads(tmp_path: Path) -> None:
    timer = FakeTimer({"gelu": (10.0, 3.0)})
    chooser = KernelChooser(tmp_path / "k.json", timer=timer)
    chooser.decide(GELU)
    chooser.decide(Case("gelu", ((8, 64, 1024),), params=GELU.params))  # other shapes
    chooser.decide(Case("gelu", GELU.shapes, params=(("approximate", "tanh"), ("bias", True))))  # other form
    chooser.decide(Case("gelu", GELU.shapes, dtype="float64", params=GELU.params))
    assert chooser.measurements == 4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert chooser.decide(GELU).source == "measured"
    finally:
        torch.set_num_threads(threads)
    assert chooser.decide(GELU).source == "cached"
    assert chooser.measurements == 5


def test_decisions_round_trip_through_json() -> None:
    decision = Decision(GELU, PYTORCH, "measured", 10.0, 3.0)
    assert Decision.from_json(json.loads(json.dumps(decision.to_json()))) == decision
    assert "3.00 ms vs ORT 10.00 ms" in decision.reason()


def test_the_cache_lives_in_the_export_cache_directory_when_one_is_set(tmp_path: Path) -> None:
    config = Config.from_table({}, env={"ORTMODULE_CACHE_DIR": str(tmp_path / "graphs"), "XDG_CACHE_HOME": "/x"})
    assert kernel_choice.cache_path(config) == tmp_path / "graphs" / "kernel_choice.json"
    config = Config.from_table({}, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert kernel_choice.cache_path(config) == tmp_path / "ortcore" / "kernel_choice.json"


# -- options ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [("auto", ("auto",)), (["auto"], ("auto",)), ("all", plugin.ROUTABLE_OPS), ("none", ()), (["gelu"], ("gelu",))],
)
def test_switch_values(tmp_path: Path, value: Any, expected: tuple) -> None:
    assert make_host(tmp_path, value).config.plugin_options("aten_fallback").torch_kernels == expected


@pytest.mark.parametrize("value", [["auto", "gelu"], "all,linear", "automatic"])
def test_bad_switch_values_name_what_is_allowed(tmp_path: Path, value: Any) -> None:
    with pytest.raises(OptionError, match="'auto', 'all', 'none'"):
        make_host(tmp_path, value)


def test_export_key_of_auto_names_the_mode_and_the_machine(tmp_path: Path) -> None:
    key = make_host(tmp_path, "auto").hooks.export_key()
    assert key["aten_fallback.torch_kernels"] == "auto"
    assert key["aten_fallback.kernel_choice"]["threads"] == torch.get_num_threads()
    assert make_host(tmp_path, ["gelu"]).hooks.export_key() == {"aten_fallback.torch_kernels": ["gelu"]}


# -- models -------------------------------------------------------------------------------------------------------


class MixedModel(nn.Module):
    """Every routable op: two embeddings (one with a padding row), linear, GELU, LayerNorm, cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.words = nn.Embedding(30, 16, padding_idx=0)
        self.positions = nn.Embedding(12, 16)
        self.up = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.words(ids) + self.positions(torch.arange(ids.shape[1]))
        logits = self.head(self.norm(F.gelu(self.up(h))))
        return logits, F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 30, (4, 12), generator=gen), torch.randint(0, 5, (4, 12), generator=gen)) for _ in range(n)
    ]


def _aten_ops(path: Path) -> set[str]:
    model = onnx.load(str(path))
    return {
        next(a.s.decode() for a in n.attribute if a.name == "operator")
        for n in model.graph.node
        if n.op_type == "ATen" and n.domain == plugin.ATEN_DOMAIN
    }


TABLE = {
    "embedding": (1.0, 2.0),
    "gelu": (5.0, 1.0),
    "layer_norm": (5.0, 1.0),
    "cross_entropy": (1.0, 2.0),
    "linear": (1.0, 2.0),
}


def test_auto_routes_what_measured_faster_and_matches_torch(tmp_path: Path, fake_chooser) -> None:
    host = make_host(tmp_path)
    chooser, timer = fake_chooser(TABLE, host)
    debug = DebugOptions(save_onnx=True, onnx_prefix="auto", save_path=str(tmp_path))
    ort, ref = ort_and_torch(MixedModel(), host=host, debug_options=debug)
    batches = _batches(6)
    (out, loss), (out_ref, loss_ref) = ort(*batches[0]), ref(*batches[0])
    assert_outputs_match(out, out_ref)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    # The padding row's embedding needs PyTorch's gradient: routed without measuring; the rest as the timer says.
    assert _aten_ops(tmp_path / "auto_pre_grad_training.onnx") == {"embedding", "gelu", "native_layer_norm"}
    measured = {c.op for c in timer.cases}
    assert measured == {"embedding", "gelu", "layer_norm", "cross_entropy", "linear"}
    assert all(c.shapes for c in timer.cases)  # real sizes, even for values fed by graph inputs
    assert ((30, 16), (4, 12)) not in [c.shapes for c in timer.cases]  # the padded embedding was not measured
    sides = {(d.case.op, d.side, d.source) for d in plugin.kernel_choices(ort)}
    assert ("embedding", PYTORCH, "required") in sides and ("embedding", ORT, "measured") in sides
    assert {("gelu", PYTORCH, "measured"), ("layer_norm", PYTORCH, "measured"), ("linear", ORT, "measured")} <= sides
    assert "1.00 ms vs ORT 5.00 ms" in ort.explain().routed()["gelu"]
    assert "gelu" in plugin.explain_kernel_choices(ort)
    # explain() itself shows each measured call's decision and what measuring cost (the plugin's explain notes)
    text = str(ort.explain())
    assert plugin.explain_kernel_choices(ort) in text and kernel_choice.measurement_summary() in text, text
    # a multi-step loss curve
    opt, opt_ref = adamw(ort), adamw(ref)
    for batch in batches[1:]:
        for model, optimizer in ((ort, opt), (ref, opt_ref)):
            optimizer.zero_grad()
            model(*batch)[1].backward()
            optimizer.step()
        assert_losses_match(ort(*batch)[1], ref(*batch)[1])
    # A second model on the same host measures nothing.
    count = chooser.measurements
    second = ort_and_torch(MixedModel(), host=host)[0]
    second(*batches[0])[1].backward()
    assert chooser.measurements == count and len(timer.cases) == count


def test_auto_with_ort_faster_everywhere_leaves_only_required_aten_nodes(tmp_path: Path, fake_chooser) -> None:
    host = make_host(tmp_path)
    fake_chooser({op: (1.0, 2.0) for op in TABLE}, host)
    debug = DebugOptions(save_onnx=True, onnx_prefix="ort", save_path=str(tmp_path))
    ort, ref = ort_and_torch(MixedModel(), host=host, debug_options=debug)
    batch = _batches(1)[0]
    (out, loss), (out_ref, loss_ref) = ort(*batch), ref(*batch)
    assert_outputs_match(out, out_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert _aten_ops(tmp_path / "ort_pre_grad_training.onnx") == {"embedding"}
    # model.explain() says why ORT's kernels were kept, beside them
    why = {row["op"]: row["reason"] for row in ort.explain() if row["runs_on"] == "ORT"}
    assert "PyTorch's kernel not faster" in why["LayerNormalization"] and "2.00 ms vs ORT 1.00 ms" in why["Gemm"]


# The word embedding has a padding row, whose gradient ONNX's Gather gets wrong: it runs on PyTorch's kernel anyway.
@pytest.mark.parametrize("kernels, expected", [(["gelu"], {"gelu", "embedding"}), ("none", {"embedding"})])
def test_an_explicit_list_and_none_route_as_told_without_measuring(
    tmp_path: Path, fake_chooser, kernels: Any, expected: set
) -> None:
    host = make_host(tmp_path, kernels)
    chooser, _ = fake_chooser(TABLE, host)
    debug = DebugOptions(save_onnx=True, onnx_prefix="list", save_path=str(tmp_path))
    ort = ort_and_torch(MixedModel(), host=host, debug_options=debug)[0]
    ort(*_batches(1)[0])[1].backward()
    assert _aten_ops(tmp_path / "list_pre_grad_training.onnx") == expected
    assert chooser.measurements == 0 and plugin.kernel_choices(ort) == []


def test_a_graph_from_the_export_cache_comes_with_its_choice(tmp_path: Path, fake_chooser) -> None:
    env = {"ORTMODULE_CACHE_DIR": str(tmp_path / "graphs")}
    plugins = {"export_cache": export_cache}
    host = make_host(tmp_path, plugins=plugins, env=env)
    chooser, _ = fake_chooser(TABLE, host)
    first = ort_and_torch(MixedModel(), host=host)[0]
    first(*_batches(1)[0])
    assert (tmp_path / "graphs" / "kernel_choice.json").exists()
    # Another process: its own chooser, which may not measure, and the graph comes from the export cache.
    host2 = make_host(tmp_path, plugins=plugins, env=env)
    chooser2, timer2 = fake_chooser({op: (1.0, 2.0) for op in TABLE}, host2)
    (tmp_path / "graphs" / "kernel_choice.json").unlink()
    second = ort_and_torch(MixedModel(), host=host2)[0]
    second(*_batches(1)[0])
    assert second.state_machine.counters.exports == 1 and timer2.cases == []
    assert plugin.kernel_choices(second) == plugin.kernel_choices(first)
    assert "gelu" in second.explain().routed()


# -- measure = "later": the first steps on the default list, the measured choice from a later step -----------------


def _train(ort: nn.Module, ref: nn.Module, batches: list, on_step: Any = None) -> None:
    """AdamW steps on both sides, losses compared at every step and every gradient at each step."""
    opt, opt_ref = adamw(ort), adamw(ref)
    for step, batch in enumerate(batches):
        opt.zero_grad()
        opt_ref.zero_grad()
        loss, loss_ref = ort(*batch)[1], ref(*batch)[1]
        assert_losses_match(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(ort, ref)
        opt.step()
        opt_ref.step()
        if on_step is not None:
            on_step(step)


# Embedding and cross-entropy measured faster on ORT: the default list routes them to PyTorch.
DISAGREES = {**TABLE, "embedding": (1.0, 2.0), "cross_entropy": (1.0, 2.0)}
AGREES = {**TABLE, "embedding": (2.0, 1.0), "cross_entropy": (2.0, 1.0)}
# MixedModel's cases that are timed: the position embedding, GELU, LayerNorm, cross-entropy, two linear layers (the
# word embedding's padding row needs PyTorch's gradient: required, not timed).
CASES = 6


def test_later_starts_on_the_default_list_and_switches_to_the_measured_choice(tmp_path: Path, fake_chooser) -> None:
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "later"})
    chooser, timer = fake_chooser(DISAGREES, host)
    debug = DebugOptions(save_onnx=True, onnx_prefix="later", save_path=str(tmp_path))
    ort, ref = ort_and_torch(MixedModel(), host=host, debug_options=debug)
    seen: dict[int, tuple] = {}

    def on_step(step: int) -> None:
        counters = ort.state_machine.counters
        seen[step] = (counters.exports, len(timer.cases), _aten_ops(tmp_path / "later_pre_grad_training.onnx"))

    _train(ort, ref, _batches(6), on_step)
    default = {"embedding", "gelu", "native_layer_norm", f"{plugin.HELPER_NAMESPACE}::cross_entropy"}
    # Steps 0 and 1 on the default list, nothing timed; before step 2 the cases are timed (step 2 still runs the
    # graph it started with); step 3 runs the graph of the measured choice.
    assert seen[0] == seen[1] == (1, 0, default), seen
    assert seen[2][:2] == (1, CASES) and seen[2][2] == default, seen
    assert seen[3][0] == 2 and seen[3][2] == {"embedding", "gelu", "native_layer_norm"}, seen
    assert seen[5][:2] == (2, CASES), seen  # no more measuring, no more exports
    sides = {(d.case.op, d.side, d.source) for d in plugin.kernel_choices(ort)}
    assert {("cross_entropy", ORT, "cached"), ("embedding", ORT, "cached"), ("gelu", PYTORCH, "cached")} <= sides
    assert any("asked to export again: kernel choice measured" in t.reason for t in ort.state_machine.history)


def test_later_keeps_the_graph_when_the_measurements_agree(tmp_path: Path, fake_chooser) -> None:
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "later"})
    chooser, timer = fake_chooser(AGREES, host)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    _train(ort, ref, _batches(5))
    assert ort.state_machine.counters.exports == 1 and len(timer.cases) == CASES
    # the decisions are on file for the next process, which starts on them without timing anything
    assert len(json.loads(kernel_choice.cache_path(host.config).read_text())["entries"]) == CASES


def test_later_on_a_busy_machine_postpones_measuring_until_the_load_passes(
    tmp_path: Path, fake_chooser, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Load, "pct", 60.0)
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "later"})
    chooser, timer = fake_chooser(DISAGREES, host)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    timed: dict[int, int] = {}

    def on_step(step: int) -> None:
        timed[step] = len(timer.cases)
        if step == 3:
            monkeypatch.setattr(_Load, "pct", 1.0)  # the load has passed by step 4

    _train(ort, ref, _batches(7), on_step)
    # step 2: the machine was busy since the first step: nothing timed (it would be provisional); step 4 (twice the
    # step): the machine was idle since, timed, final, and the graph of the measured choice is exported
    assert timed[1] == timed[2] == timed[3] == 0 and timed[4] == timed[6] == CASES, timed
    assert ort.state_machine.counters.exports == 2
    events = kernel_choice.measurement_record.events
    assert [(e.step, e.measured) for e in events] == [(2, 0), (4, CASES)], events
    assert "postponed: other processes took 60% of the CPU" in events[0].why
    assert all(
        e["source"] == "measured"
        for e in json.loads(kernel_choice.cache_path(host.config).read_text())["entries"].values()
    )


class _LoadWhileTiming(FakeTimer):
    """Other processes load the machine while each case is timed, never between steps."""

    def __call__(self, case: Case) -> tuple[float, float]:
        _Load.pct = 60.0
        return super().__call__(case)


def test_a_case_measured_under_load_is_retaken_once_then_the_default_list_keeps_it(
    tmp_path: Path, fake_chooser, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Load, "pct", 0.0)
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "later"})
    chooser, _ = fake_chooser(DISAGREES, host)
    timer = chooser.timer = _LoadWhileTiming(DISAGREES)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    timed: dict[int, int] = {}

    def on_step(step: int) -> None:
        timed[step] = len(timer.cases)
        monkeypatch.setattr(_Load, "pct", 0.0)  # idle between steps

    _train(ort, ref, _batches(20), on_step)
    # step 2: timed, provisional; step 4: timed once more, provisional again; then never again in this process
    assert timed[1] == 0 and timed[2] == timed[3] == CASES and timed[4] == timed[19] == 2 * CASES, timed
    assert ort.state_machine.counters.exports == 1  # a provisional measurement never changes the graph
    events = kernel_choice.measurement_record.events
    assert [(e.step, e.measured) for e in events] == [(2, CASES), (4, CASES), (4, 0)], events
    assert events[0].why.startswith("first measurement") and "provisional" in events[0].why
    assert events[1].why.startswith(f"retaken: {CASES} case(s) measured while other processes took up to 60%")
    assert "kept on the default list for this process" in events[2].why
    summary = kernel_choice.measurement_summary()
    assert f"{2 * CASES} case(s) measured on later steps" in summary and "1 retaken" in summary, summary
    assert not kernel_choice.cache_path(host.config).exists()  # nothing final: the next process measures


class _SlowTimer(FakeTimer):
    def __call__(self, case: Case) -> tuple[float, float]:
        time.sleep(0.07)
        return super().__call__(case)


def test_measuring_stays_within_the_budget_and_switches_once_every_case_is_measured(
    tmp_path: Path, fake_chooser, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernel_choice, "MEASURE_BUDGET_SECONDS", 0.12)
    monkeypatch.setattr(kernel_choice, "MEASURE_BUDGET_FRACTION", 0.0)
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "later"})
    chooser, _ = fake_chooser(DISAGREES, host)
    timer = chooser.timer = _SlowTimer(DISAGREES)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    _train(ort, ref, _batches(10))
    record = kernel_choice.measurement_record
    # step 2: one case (a second would not fit), step 4: one more (begun within the budget, finished past it), step
    # 8: the budget is spent. At most one case past the budget; the rest wait, none is timed twice
    assert record.seconds <= 0.12 + 0.15, record.summary()
    assert 0 < len(timer.cases) < CASES and len(set(timer.cases)) == len(timer.cases)
    assert any("postponed: the measuring budget is spent" in e.why for e in record.events), record.summary()
    assert ort.state_machine.counters.exports == 1  # no export on a partial measurement


def test_export_mode_retakes_a_case_measured_under_load_once_on_a_later_step(
    tmp_path: Path, fake_chooser, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Load, "pct", 60.0)  # the export measures on a busy machine: provisional
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "export"})
    chooser, timer = fake_chooser(DISAGREES, host)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    timed: dict[int, int] = {}

    def on_step(step: int) -> None:
        timed[step] = len(timer.cases)
        monkeypatch.setattr(_Load, "pct", 0.0)  # then the load passes

    _train(ort, ref, _batches(6), on_step)
    assert timed[0] == timed[1] == CASES and timed[2] == timed[5] == 2 * CASES, timed
    assert ort.state_machine.counters.exports == 1  # the same sides, final now: the graph stays
    entries = json.loads(kernel_choice.cache_path(host.config).read_text())["entries"]
    assert len(entries) == CASES and {e["source"] for e in entries.values()} == {"measured"}
    assert kernel_choice.measurement_record.events[0].why.startswith("retaken")


def test_a_graph_with_choices_not_measured_yet_is_export_cached_under_its_state(tmp_path: Path, fake_chooser) -> None:
    env = {"ORTMODULE_CACHE_DIR": str(tmp_path / "graphs"), "ORTCORE_KERNEL_MEASURE": "later"}
    plugins = {"export_cache": export_cache}
    host = make_host(tmp_path, plugins=plugins, env=env)
    fake_chooser(DISAGREES, host)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    entries = lambda: sorted(p.name.split(".rank0")[1] for p in (tmp_path / "graphs").glob("*.ortgraph"))  # noqa: E731
    _train(ort, ref, _batches(2))
    assert entries() == [".deferred.ortgraph"]  # the graph that ran, though its choices were for now only
    # A process that trains one step meanwhile loads it instead of exporting.
    host_b = make_host(tmp_path, plugins=plugins, env=env)
    fake_chooser(DISAGREES, host_b)
    short = ort_and_torch(MixedModel(), host=host_b)[0]
    _train(short, ort_and_torch(MixedModel())[1], _batches(1))
    assert (short.state_machine.counters.exports, short.state_machine.counters.cache_loads) == (1, 1)
    _train(ort, ref, _batches(3))
    assert entries() == [".ortgraph"]  # the graph exported on the measured choice replaces it
    # The next process starts on that graph, measuring nothing.
    host2 = make_host(tmp_path, plugins=plugins, env=env)
    _, timer2 = fake_chooser(AGREES, host2)
    second = ort_and_torch(MixedModel(), host=host2)[0]
    _train(second, ort_and_torch(MixedModel())[1], _batches(4))
    assert timer2.cases == [] and second.state_machine.counters.exports == 1
    assert ("embedding", ORT) in {(d.case.op, d.side) for d in plugin.kernel_choices(second)}


def _measured(op: str, ort_ms: float, torch_ms: float, source: str = "measured") -> Decision:
    return Decision(Case(op, ((8, 16),)), choose(ort_ms, torch_ms), source, ort_ms, torch_ms)


@pytest.mark.parametrize(
    ("measured", "switch"),
    [
        ([_measured("gelu", 1.0, 3.0)], True),  # 2 ms saved: worth an export
        ([_measured("gelu", 1.0, 1.5)], False),  # 0.5 ms a step: on file for the next process only
        ([_measured("gelu", 1.0, 1.6), _measured("layer_norm", 1.0, 1.6)], True),  # 1.2 ms together
        ([_measured("embedding", 1.0, 1.05)], False),  # a tie keeps the graph's side, even where the tie-break is ORT
        ([_measured("gelu", 1.0, 3.0, "provisional")], False),  # measured under load: never switches
    ],
)
def test_a_measured_choice_replaces_the_graph_only_where_it_is_worth_an_export(measured: list, switch: bool) -> None:
    in_graph = {d.case: PYTORCH for d in measured}  # the default list ran all of them on PyTorch
    assert bool(kernel_choice.worth_switching(measured, in_graph)) is switch


def test_a_model_whose_sizes_change_is_exported_again_for_its_kernel_choice_once(tmp_path: Path, fake_chooser) -> None:
    """Graphs exported at other sizes hold other cases: measured (for the next process), not an export each."""
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "later"})
    _, timer = fake_chooser(DISAGREES, host)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, 30, (4, seq), generator=gen), torch.randint(0, 5, (4, seq), generator=gen))
        for seq in (12, 12, 12, 12, 10, 10, 9, 11, 10, 9)
    ]
    _train(ort, ref, batches)
    again = [t for t in ort.state_machine.history if "asked to export again" in t.reason]
    assert len(again) == 1, [t.reason for t in ort.state_machine.history]
    # the static graph, the one of the measured choice, the graph dynamic in the sequence (serving 10, 9 and 11)
    assert ort.state_machine.counters.exports == 3
    # the dynamic graph's cases (at sequence 10) were measured too, at step 8: twice the step its session started
    assert len(timer.cases) > CASES


@pytest.mark.parametrize("mode", ["export", "later", "off"])
def test_measure_modes_are_accepted(tmp_path: Path, mode: str) -> None:
    assert (
        make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": mode}).config.plugin_options("aten_fallback").measure == mode
    )


def test_a_bad_measure_mode_names_what_is_allowed(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="ORTCORE_KERNEL_MEASURE='sometimes' is not allowed; allowed: later"):
        make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "sometimes"})


def test_off_keeps_the_default_list_and_times_nothing(tmp_path: Path, fake_chooser) -> None:
    host = make_host(tmp_path, env={"ORTCORE_KERNEL_MEASURE": "off"})
    _, timer = fake_chooser(DISAGREES, host)
    ort, ref = ort_and_torch(MixedModel(), host=host)
    _train(ort, ref, _batches(4))
    assert timer.cases == [] and ort.state_machine.counters.exports == 1
    assert {d.source for d in plugin.kernel_choices(ort)} <= {"unmeasured", "required"}


@pytest.mark.slow
def test_measured_choice_on_bert_matches_torch_and_is_not_measured_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real timings of BERT's calls (no fake timer); the machine is seen as idle (``_Load``), so that a measurement
    taken while other processes run is not provisional (which the fake-timer tests above cover) and is written."""
    monkeypatch.setattr(kernel_choice, "OthersCPU", _Load)
    host = make_host(tmp_path)
    path = kernel_choice.cache_path(host.config)
    chooser = kernel_choice.chooser_for(host.config)
    ort, ref = ort_and_torch(tiny_bert(), host=host)
    batch = make_batches(bert_batch, 1)[0]
    (_, loss), (_, loss_ref) = hf_step(ort, batch), hf_step(ref, batch)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    measured = chooser.measurements
    assert measured >= 4 and path.exists()
    decisions = plugin.kernel_choices(ort)
    assert all(d.ort_ms is not None and d.torch_ms is not None for d in decisions if d.source == "measured")
    kernel_choice._choosers.pop(path)  # as a new process would: only the file is left
    again = kernel_choice.chooser_for(host.config)
    hf_step(ort_and_torch(tiny_bert(), host=host)[0], batch)
    assert again.measurements == 0


# -- the measured graph pairs ----------------------------------------------------------------------------------------

MEASURED_CASES = [
    Case("embedding", ((50, 16), (4, 7)), params=(("padding_idx", -1),)),
    Case("gelu", ((4, 7, 16),), params=(("approximate", "none"), ("bias", True))),
    Case("gelu", ((4, 7, 16),), params=(("approximate", "tanh"), ("bias", False))),
    Case("layer_norm", ((4, 7, 16), (16,)), params=(("eps", 1e-5), ("grad_bias", True), ("grad_weight", True))),
    Case("cross_entropy", ((6, 5), (6,)), params=(("ignore_index", -100), ("reduction", 1))),
    Case("cross_entropy", ((6, 5), (6,), (5,)), params=(("ignore_index", 2), ("reduction", 2))),
    Case(
        "linear", ((4, 7, 16), (8, 16), (8,)), params=(("grad_bias", True), ("grad_input", True), ("grad_weight", True))
    ),
    # A frozen weight; a frozen input never gets here (ORT builds an ATen node's gradient only when its first input
    # needs one, so such a call keeps ORT's kernel: torch_kernels.gradient_reaches_first_input).
    Case("linear", ((6, 16), (8, 16)), params=(("grad_input", True), ("grad_weight", False))),
    Case(
        "linear",
        ((8,), (6, 16), (16, 8)),
        params=(("alpha", 1.0), ("beta", 1.0), ("grad_bias", True), ("grad_mat1", True), ("grad_mat2", True)),
        form="addmm",
    ),
]


@pytest.mark.parametrize("case", MEASURED_CASES, ids=lambda c: f"{c.op}-{c.form or 'call'}-{len(c.shapes)}")
def test_each_measured_graph_pair_computes_torchs_output_on_both_sides(case):
    """A measurement compares two graphs; both must compute the op as torch does (rtol 1e-5, atol 1e-5), or the
    choice compares different work. ORT's side and the ATen side run forward + backward through the core's
    measurement sessions, and the timings are positive."""
    from ortcore.api import measurement_sessions
    from ortcore_plugins.aten_fallback import measurement
    from ortcore_plugins.services.torch_kernels import prepare_runtime

    prepare_runtime()
    pair = measurement.one_op(case, torch.Generator().manual_seed(0))
    feeds = [t for _, t in pair.inputs]
    before = measurement_sessions()
    for nodes, aten in ((pair.ort_nodes, False), (pair.torch_nodes, True)):
        session = measurement._session(measurement._model(pair, nodes, aten), pair)
        outputs, state = session.run_forward(feeds)
        torch.testing.assert_close(outputs[0], pair.output, rtol=1e-5, atol=1e-5, msg=f"aten={aten}")
        grad = torch.ones_like(pair.output)
        session.run_backward([grad], [(tuple(grad.shape), grad.dtype)], state)
    assert measurement_sessions() == before + 2
    ort_ms, torch_ms = measurement.measure_case(case, repeats=3, budget=0.05)
    assert ort_ms > 0 and torch_ms > 0


def test_a_case_nobody_measures_is_named():
    from ortcore_plugins.aten_fallback import measurement

    with pytest.raises(ValueError, match=r"no measurement for op 'softmax'; measured: cross_entropy, embedding"):
        measurement.one_op(Case("softmax", ((2, 3),)), torch.Generator())
