"""runtime_inspector: input density of embedding indices and loss labels, memory per phase, options, cost when off.

Every test runs the model in ORT through a host that registers only this plugin, reads the tables from the
``ortcore.runtime_inspector`` log records, and checks that gradients still match PyTorch.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import ortcore_plugins.runtime_inspector as plugin
from ortcore import ORTModule
from ortcore.errors import OptionError
from ortcore.testing import assert_matches_torch

VOCAB, PAD = 20, 1
# A fallback to PyTorch would make every parity check pass without ORT: fail instead.
STRICT = {"fallback_policy": "FALLBACK_DISABLE"}


class TinyLM(torch.nn.Module):
    """Embedding with a padding_idx, a position embedding without one, and a cross-entropy loss.

    ``shift`` makes the loss read ``labels[:, 1:]`` reshaped, as causal LMs do: the density reported must be that
    of the shifted labels, which are not a user input.
    """

    def __init__(self, shift: bool = False):
        super().__init__()
        self.shift = shift
        self.tokens = torch.nn.Embedding(VOCAB, 8, padding_idx=PAD)
        self.positions = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        logits = self.head(torch.tanh(self.tokens(input_ids) + self.positions(positions)))
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batch(
    padded_per_row: int, ignored_per_row: int, rows: int = 4, length: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with ``padded_per_row`` trailing pads, labels with ``ignored_per_row`` trailing -100s."""
    ids = torch.randint(2, VOCAB, (rows, length))
    labels = ids.clone()
    if padded_per_row:
        ids[:, -padded_per_row:] = PAD
    if ignored_per_row:
        labels[:, -ignored_per_row:] = -100
    return ids, labels


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="ortcore.runtime_inspector")
    return caplog


def tables(records: pytest.LogCaptureFixture, start: str) -> list[str]:
    """The messages of the plugin's log records that start with ``start``, in order."""
    return [
        r.getMessage()
        for r in records.records
        if r.name == "ortcore.runtime_inspector" and r.getMessage().startswith(start)
    ]


def row(table: str, consumer: str) -> list[str]:
    """The cells of the row whose consumer column is ``consumer``."""
    for line in table.splitlines()[2:]:
        if consumer in line:
            return line.split()
    raise AssertionError(f"no row for {consumer!r} in:\n{table}")


# -- input density ---------------------------------------------------------------------------------------------


def test_density_of_padded_tokens_and_ignored_labels_is_logged_and_gradients_match(ortcore_host, records):
    host = ortcore_host({"runtime_inspector": plugin}, env={"ORTMODULE_PRINT_INPUT_DENSITY": "1"})
    ids, labels = batch(padded_per_row=2, ignored_per_row=4)  # a quarter of the tokens pad, half the labels ignored
    assert_matches_torch(TinyLM(), (ids, labels), host=host, **STRICT)

    [table] = tables(records, "input density at step 0")
    assert row(table, "embedding tokens.weight")[-3:] == [str(PAD), "0.750", "24/32"]
    assert row(table, "labels of SoftmaxCrossEntropyLoss")[-3:] == ["-100", "0.500", "16/32"]
    assert "positions.weight" not in table  # no padding_idx: always dense, not reported


def test_density_of_derived_labels_is_that_of_the_tensor_the_loss_reads(ortcore_host, records):
    host = ortcore_host({"runtime_inspector": plugin}, env={"ORTMODULE_PRINT_INPUT_DENSITY": "1"})
    ids, labels = batch(padded_per_row=0, ignored_per_row=2)
    model = assert_matches_torch(TinyLM(shift=True), (ids, labels), host=host, **STRICT)

    # labels[:, 1:] of 4 rows x 8: 7 per row, of which 5 are not ignored; the full input would say 24/32.
    [table] = tables(records, "input density at step 0")
    assert row(table, "labels of SoftmaxCrossEntropyLoss")[-3:] == ["-100", "0.714", "20/28"]
    assert row(table, "labels of")[0] == "labels"  # the user input it is computed from
    assert row(table, "embedding tokens.weight")[-2:] == ["1.000", "32/32"]

    # Each training step is measured again, on that step's batch.
    ids, labels = batch(padded_per_row=4, ignored_per_row=0)
    model(ids, labels).backward()
    [table] = tables(records, "input density at step 1")
    assert row(table, "embedding tokens.weight")[-2:] == ["0.500", "16/32"]
    assert row(table, "labels of")[-2:] == ["1.000", "28/28"]


def test_density_is_not_logged_for_forwards_without_gradient(ortcore_host, records):
    host = ortcore_host({"runtime_inspector": plugin}, env={"ORTMODULE_PRINT_INPUT_DENSITY": "1"})
    model = ORTModule(TinyLM(), host=host, **STRICT)
    with torch.no_grad():
        model(*batch(2, 2))
    assert tables(records, "input density") == []


def test_find_sources_reads_aten_embedding_and_loss_nodes():
    """Embeddings and losses routed to torch's kernels (ATen nodes) carry padding_idx and ignore_index as inputs."""
    const = [
        helper.make_node("Constant", [], ["pad"], value=helper.make_tensor("v", TensorProto.INT64, [], [0])),
        helper.make_node("Constant", [], ["ignore"], value=helper.make_tensor("v", TensorProto.INT64, [], [-1])),
        helper.make_node("Constant", [], ["no"], value=helper.make_tensor("v", TensorProto.BOOL, [], [False])),
        helper.make_node("Constant", [], ["mean"], value=helper.make_tensor("v", TensorProto.INT64, [], [1])),
    ]
    nodes = [
        *const,
        helper.make_node("ATen", ["w", "ids", "pad", "no", "no"], ["h"], domain="com.microsoft", operator="embedding"),
        helper.make_node(
            "ATen",
            ["h", "labels", "", "mean", "ignore"],
            ["loss"],
            domain="com.microsoft",
            operator="ortcore_aten::cross_entropy",
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, ["b"]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    found = plugin.find_sources(helper.make_model(graph), ["ids", "labels"])
    assert ("ids", "embedding", "w", 0, "w") in found
    assert ("labels", "label", "cross_entropy", -1, None) in found


@pytest.mark.slow
def test_density_of_a_hugging_face_bert_batch(ortcore_host, records):
    """BERT's word embedding pads with pad_token_id; masked-LM labels are -100 except at masked positions."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    # The audit off: this loss sends no gradient to the padding row, but the audit's random output gradient does,
    # and with only this plugin loaded ONNX's Gather gives that row a gradient torch leaves zero (aten_fallback runs
    # such an embedding on PyTorch's kernel; with the audit on, the mismatch is named).
    host = ortcore_host(
        {"runtime_inspector": plugin}, env={"ORTMODULE_PRINT_INPUT_DENSITY": "1", "ORTCORE_VERIFY_GRADIENTS": "0"}
    )
    ids = torch.randint(1, 64, (2, 16))
    ids[:, 12:] = 0  # a quarter of the tokens pad
    labels = torch.full_like(ids, -100)
    labels[:, :4] = ids[:, :4]  # a quarter of the labels count
    kwargs = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}
    assert_matches_torch(
        transformers.BertForMaskedLM(config).train(), (), kwargs, host=host, loss_fn=lambda out: out.loss, **STRICT
    )
    [table] = tables(records, "input density at step 0")
    assert row(table, "embedding bert.embeddings.word_embeddings.weight")[-3:] == ["0", "0.750", "24/32"]
    assert row(table, "labels of")[-3:] == ["-100", "0.250", "8/32"]


# -- memory ------------------------------------------------------------------------------------------------------


def test_memory_table_has_every_phase_of_each_step_and_gradients_match(ortcore_host, records):
    host = ortcore_host(
        {"runtime_inspector": plugin}, table={"plugins": {"runtime_inspector": {"print_memory_stats": True}}}
    )
    ids, labels = batch(2, 2)
    model = assert_matches_torch(TinyLM(), (ids, labels), host=host, **STRICT)
    model(ids, labels).backward()

    step0, step1 = tables(records, "memory at step")
    assert step0.startswith("memory at step 0 (MiB)") and step1.startswith("memory at step 1 (MiB)")
    lines = step1.splitlines()
    assert lines[1].split() == ["phase", "rss", "peak", "rss", "rss", "delta"]
    assert [line.split()[0] for line in lines[2:6]] == ["pre_forward", "post_forward", "pre_backward", "post_backward"]
    for line in lines[2:6]:
        rss, peak = float(line.split()[1]), float(line.split()[2])
        assert 10 < rss <= peak  # MiB of a live Python process with torch and ORT loaded
    assert lines[6].split(",")[0].split() == ["parameters", "0.0"]  # 468 floats

    model(ids, labels)  # a forward whose backward never runs: logged at the next forward
    with torch.no_grad():
        model.eval()
        model(ids, labels)
    [dangling] = tables(records, "memory at step 2 (no backward) (MiB)")
    assert [line.split()[0] for line in dangling.splitlines()[2:4]] == ["pre_forward", "post_forward"]
    [no_grad] = tables(records, "memory at forward 0 without gradient (MiB)")
    assert [line.split()[0] for line in no_grad.splitlines()[2:4]] == ["pre_forward", "post_forward"]


def test_cuda_columns_come_from_the_sampler():
    """The CUDA path cannot run here: feed the table a sample as a CUDA device would give one."""
    cuda = {
        "allocated": 3 << 20,
        "max allocated": 5 << 20,
        "reserved": 8 << 20,
        "max reserved": 8 << 20,
        "inactive": 0,
        "device used": 9 << 20,
    }
    samples = [plugin.MemorySample(phase, 100 << 20, 120 << 20, cuda) for phase in ("pre_forward", "post_forward")]
    text = plugin.MemoryStatsInspector(torch.nn.Linear(2, 2), all_steps=False).format(samples)
    header = text.splitlines()[0]
    for column in ("allocated", "max allocated", "reserved", "device used"):
        assert column in header
    assert text.splitlines()[1].split()[4:] == ["3.0", "5.0", "8.0", "8.0", "0.0", "9.0"]


def test_steps_logged_are_the_first_ten_then_powers_of_two():
    assert [s for s in range(70) if plugin.should_log(s, all_steps=False)] == [*range(10), 16, 32, 64]
    assert all(plugin.should_log(s, all_steps=True) for s in range(70))


# -- options and cost when off -------------------------------------------------------------------------------------


def test_off_by_default_contributes_no_inspector_and_analyses_no_graph(ortcore_host, records):
    host = ortcore_host({"runtime_inspector": plugin})
    model = ORTModule(TinyLM(), host=host, **STRICT)
    assert all(calls == [] for calls in model._ortcore.phases.values())
    model(*batch(2, 2)).backward()
    sessions = [session for _graph, session in model.state_machine._sessions.values()]
    assert sessions and not any(session in plugin.PROBES for session in sessions)
    assert tables(records, "") == []


@pytest.mark.parametrize(
    ("table", "env", "message"),
    [
        ({"print_input_density": "sometimes"}, {}, "plugins.runtime_inspector.print_input_density='sometimes'"),
        ({}, {"ORTMODULE_PRINT_MEMORY_STATS": "2"}, "ORTMODULE_PRINT_MEMORY_STATS='2' is not a boolean"),
        ({"print_density": True}, {}, "Did you mean 'print_input_density'?"),
    ],
)
def test_bad_option_values_name_the_key(ortcore_host, table, env, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        ortcore_host({"runtime_inspector": plugin}, table={"plugins": {"runtime_inspector": table}}, env=env)


def test_environment_overrides_the_file(ortcore_host):
    host = ortcore_host(
        {"runtime_inspector": plugin},
        table={"plugins": {"runtime_inspector": {"print_input_density": True}}},
        env={"ORTMODULE_PRINT_INPUT_DENSITY": "0"},
    )
    assert host.config.plugin_options("runtime_inspector").print_input_density is False
    assert plugin.ortcore_runtime_inspectors(host.config, torch.nn.Linear(2, 2)) == []


def test_format_table_aligns_text_left_and_numbers_right():
    text = plugin.format_table(("name", "value"), [("a", "1.5"), ("long name", "10")])
    assert text.splitlines() == ["  name       value", "  a            1.5", "  long name     10"]
