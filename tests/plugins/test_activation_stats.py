"""activation_stats: a record per submodule output and gradient, with statistics equal to torch's own."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

import ortcore_plugins.activation_stats as plugin
import ortcore_plugins.activation_stats.subscriber as subscriber_module
from ortcore.hooks import SubscriberBase
from ortcore.hookspecs import hookimpl
from ortcore.host import set_host
from ortcore.testing import ACTIVATION_NET_NAMES, ActivationNet, make_host


@pytest.fixture
def hooks_api():
    """``ortcore.hooks`` with only this plugin installed; every subscription is removed afterwards."""
    previous = set_host(make_host({"activation_stats": plugin}))
    import ortcore.hooks as hooks

    yield hooks
    for subscription in list(hooks.GlobalSubscriberManager._subscriptions.values()):
        hooks.GlobalSubscriberManager.unsubscribe(subscription.model)
    set_host(previous)


def capture(model):
    """Separate forward hooks and tensor hooks: name -> tensor, for outputs and their gradients."""
    forward, backward = {}, {}
    root = type(model).__name__

    def hook(path):
        def record(_m, _a, output):
            import torch.utils._pytree as pytree

            for key, leaf in pytree.tree_flatten_with_path(output)[0]:
                if isinstance(leaf, torch.Tensor):
                    name = path + pytree.keystr(key)
                    forward[name] = leaf.detach().clone()
                    if leaf.requires_grad:
                        leaf.register_hook(lambda g, n=name: backward.__setitem__(n, g.detach().clone()))

        return record

    for path, module in model.named_modules():
        module.register_forward_hook(hook(path or root))
    return forward, backward


def read_step(folder):
    """A step's records by (kind, name), from either layout (records.jsonl, or one file per record)."""
    records = {}
    for file in sorted(os.listdir(folder)):
        with open(os.path.join(folder, file)) as f:
            found = [json.loads(line) for line in f] if file == plugin.RECORDS_FILE else [json.load(f)]
        for record in found:
            records[(record["kind"], record["name"])] = record
    return records


def assert_stats(record, tensor):
    t = tensor.double()
    finite = t[torch.isfinite(t)]
    assert record["shape"] == list(tensor.shape) and record["numel"] == tensor.numel()
    assert record["dtype"] == str(tensor.dtype).removeprefix("torch.")
    assert record["min"] == finite.min().item() and record["max"] == finite.max().item()
    assert record["mean"] == pytest.approx(finite.mean().item(), rel=1e-6, abs=1e-12)
    if finite.numel() > 1:
        assert record["std"] == pytest.approx(finite.std().item(), rel=1e-6, abs=1e-12)
    else:
        assert record["std"] is None  # undefined for one value (torch gives NaN); strict JSON has no NaN
    assert record["abs_mean"] == pytest.approx(finite.abs().mean().item(), rel=1e-6, abs=1e-12)
    assert record["zeros"] == int((tensor == 0).sum())
    assert record["nans"] == int(torch.isnan(tensor).sum()) and record["infs"] == int(torch.isinf(tensor).sum())
    assert 1 <= len(record["samples"]) <= 8


def test_records_every_submodule_output_and_gradient_with_torch_statistics(hooks_api, tmp_path):
    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber

    model = ActivationNet()
    forward, backward = capture(model)
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "out")])
    model(torch.randn(5, 4)).square().mean().backward()
    assert not os.listdir(tmp_path / "out" / "step_0")  # written when the step is over
    GlobalSubscriberManager.unsubscribe(model)

    records = read_step(tmp_path / "out" / "step_0")
    names = ACTIVATION_NET_NAMES
    assert {n for k, n in records if k == "forward"} == names
    assert {n for k, n in records if k == "backward"} == names
    for name, tensor in forward.items():
        assert_stats(records[("forward", name)], tensor)
    for name, grad in backward.items():
        assert_stats(records[("backward", name)], grad)
    assert all(set(r) == {*plugin.RECORD_FIELDS, "samples"} for r in records.values())  # the one format definition
    orders = sorted(r["order"] for r in records.values())
    assert orders == list(range(len(records)))  # one sequence: forward first, then backward
    assert max(r["order"] for (k, _), r in records.items() if k == "forward") < min(
        r["order"] for (k, _), r in records.items() if k == "backward"
    )
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta == {"format": 1, "source": "torch", "rank": 0, "world_size": 1, "model": "ActivationNet"}
    assert os.listdir(tmp_path / "out" / "step_0") == ["records.jsonl"]  # no temporary file left


def test_one_file_per_activation_layout_holds_the_same_records(hooks_api, tmp_path):
    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber
    from ortcore_plugins.activation_stats import find_divergence

    x = torch.randn(5, 4)
    for layout, per_file in (("lines", False), ("files", True)):
        torch.manual_seed(0)
        model = ActivationNet()
        subscriber = StatisticsSubscriber(tmp_path / layout, one_file_per_activation=per_file)
        GlobalSubscriberManager.subscribe(model, [subscriber])
        model(x).square().mean().backward()
        subscriber.flush()  # the open step's records, without ending it
        GlobalSubscriberManager.unsubscribe(model)
    files = sorted(os.listdir(tmp_path / "files" / "step_0"))
    assert len(files) == 2 * len(ACTIVATION_NET_NAMES) and all(f.endswith(".json") for f in files)
    assert read_step(tmp_path / "lines" / "step_0") == read_step(tmp_path / "files" / "step_0")
    report = find_divergence(tmp_path / "lines", tmp_path / "files")
    assert not report.diverged and report.compared == 2 * len(ACTIVATION_NET_NAMES)


def test_gpt2_model_output_fields_and_gradients(hooks_api, tmp_path):
    transformers = pytest.importorskip("transformers")
    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber

    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    forward, backward = capture(model)
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "gpt2")])
    ids = torch.randint(0, 16, (2, 5))
    model(ids, labels=ids).loss.backward()
    GlobalSubscriberManager.unsubscribe(model)

    records = read_step(tmp_path / "gpt2" / "step_0")
    assert ("forward", "GPT2LMHeadModel['logits']") in records and ("forward", "GPT2LMHeadModel['loss']") in records
    assert forward and backward
    for name, tensor in forward.items():
        assert_stats(records[("forward", name)], tensor)
    for name, grad in backward.items():
        assert_stats(records[("backward", name)], grad)


def test_start_and_end_step(hooks_api, tmp_path):
    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber

    model = ActivationNet()
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "out", start_step=1, end_step=3)])
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
    model.eval()
    model(torch.randn(2, 4))  # eval forwards are not steps
    GlobalSubscriberManager.unsubscribe(model)
    assert sorted(p for p in os.listdir(tmp_path / "out") if p.startswith("step_")) == ["step_1", "step_2"]
    assert {r["step"] for r in read_step(tmp_path / "out" / "step_2").values()} == {2}


def test_inspect_activation_outside_a_subscribed_model_is_a_no_op(hooks_api):
    from ortcore.hooks import inspect_activation

    tensor = torch.randn(3)
    assert inspect_activation("free", tensor) is tensor


def test_non_finite_values_are_counted_and_excluded(hooks_api):
    tensor = torch.tensor([1.0, float("nan"), 0.0, float("inf"), -float("inf"), 3.0, -2.0])
    stats = plugin.tensor_statistics(tensor, bucket_size=2)
    finite = torch.tensor([1.0, 0.0, 3.0, -2.0], dtype=torch.float64)
    assert (stats["nans"], stats["infs"], stats["zeros"]) == (1, 2, 1)
    assert (stats["min"], stats["max"]) == (-2.0, 3.0)
    assert stats["mean"] == pytest.approx(finite.mean().item()) and stats["std"] == pytest.approx(finite.std().item())
    assert "nan" in stats["samples"] and json.dumps(stats, allow_nan=False)
    ints = plugin.tensor_statistics(torch.tensor([3, 0, -4, 7]), bucket_size=3)
    assert (ints["min"], ints["max"], ints["zeros"], ints["mean"], ints["std"]) == (-4, 7, 1, None, None)
    assert math.isfinite(plugin.tensor_statistics(torch.randn(1000), bucket_size=7)["std"])


def test_bucketed_statistics_match_one_bucket(hooks_api):
    tensor = torch.randn(1003) * 5 + 3
    one, many = plugin.tensor_statistics(tensor), plugin.tensor_statistics(tensor, bucket_size=10)
    for key in ("min", "max", "zeros", "nans", "infs", "samples"):
        assert one[key] == many[key]
    for key in ("mean", "std", "abs_mean"):
        assert many[key] == pytest.approx(one[key], rel=1e-12)


def test_existing_output_dir_without_override_errors_and_deletes_nothing(hooks_api, tmp_path):
    out = tmp_path / "out"
    (out / "step_0").mkdir(parents=True)
    (out / "step_0" / "keep.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="override_output_dir"):
        plugin.StatisticsSubscriber(out)
    assert (out / "step_0" / "keep.json").exists() and (out / "notes.txt").exists()
    plugin.StatisticsSubscriber(out, override_output_dir=True)
    assert not (out / "step_0").exists() and (out / "notes.txt").exists()


def test_unknown_subscriber_class_names_installed_ones(hooks_api):
    import ortcore.hooks

    with pytest.raises(AttributeError, match="StatisticsSubscriber"):
        ortcore.hooks.NoSuchSubscriber  # noqa: B018
    assert ortcore.hooks.subscriber_classes() == {"StatisticsSubscriber": plugin.StatisticsSubscriber}


def test_safe_name():
    assert plugin.safe_name("block[1]['skip']") == "block_1___skip__"
    assert len(plugin.safe_name("x" * 500)) == 120


def test_atomic_writes_leave_no_temporary_files(hooks_api, tmp_path, monkeypatch):
    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber

    model = ActivationNet()
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "out")])
    model(torch.randn(2, 4)).sum().backward()
    files = [f for _, _, found in os.walk(tmp_path / "out") for f in found]
    assert files and all(f.endswith(".json") and not f.startswith(".") for f in files)

    def broken_dumps(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(subscriber_module.json, "dumps", broken_dumps)
    with pytest.raises(OSError, match="disk full"):
        subscriber_module._write_json(str(tmp_path / "out" / "x.json"), {})
    assert not (tmp_path / "out" / "x.json").exists()
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "step_0"]


class Recorder(SubscriberBase):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events = []

    def on_step_start(self, step):
        self.events.append(("start", step))

    def on_forward(self, step, order, name, tensor):
        self.events.append(("forward", step, order, name))

    def on_backward(self, step, order, name, grad):
        self.events.append(("backward", step, order, name))

    def on_step_end(self, step):
        self.events.append(("end", step))


def test_subscriber_callbacks_and_plugin_contributed_subscribers(tmp_path):
    contributed = Recorder(start_step=1)
    contributor = types.SimpleNamespace(ortcore_activation_subscribers=hookimpl(lambda module: [contributed]))
    previous = set_host(make_host({"activation_stats": plugin, "contributor": contributor}))
    try:
        from ortcore.hooks import GlobalSubscriberManager

        model, mine = torch.nn.Linear(2, 2), Recorder()
        GlobalSubscriberManager.subscribe(model, [mine])
        for _ in range(2):
            model(torch.randn(1, 2)).sum().backward()
        GlobalSubscriberManager.unsubscribe(model)
        model(torch.randn(1, 2))  # no hooks left
    finally:
        set_host(previous)
    assert mine.events == [
        ("start", 0), ("forward", 0, 0, "Linear"), ("backward", 0, 1, "Linear"), ("end", 0),
        ("start", 1), ("forward", 1, 0, "Linear"), ("backward", 1, 1, "Linear"), ("end", 1),
    ]  # fmt: skip
    assert contributed.events == mine.events[4:]


def test_loading_the_plugin_and_its_commands_imports_no_torch():
    """The plugin host and ``ortcore --help`` load these modules; torch comes only with a subscriber or a tool."""
    code = (
        "import sys\n"
        "import ortcore_plugins.activation_stats as p, ortcore_plugins.activation_stats.commands\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "p.StatisticsSubscriber\n"
        "assert 'torch' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_plugin_adds_its_commands_through_the_hook(tmp_path, capsys):
    host = make_host({"activation_stats": plugin})
    parser = argparse.ArgumentParser(prog="ortcore")
    subparsers = parser.add_subparsers(dest="command")
    host.hooks.commands(subparsers)
    assert set(subparsers.choices) == {"find-divergence", "merge-activation-summary"}
    args = parser.parse_args(["find-divergence", str(tmp_path / "a"), str(tmp_path / "b"), "--no-html"])
    assert args.run(args) == 2  # bad input: the directories do not exist
    assert f"{tmp_path / 'a'}: directory not found" in capsys.readouterr().err
