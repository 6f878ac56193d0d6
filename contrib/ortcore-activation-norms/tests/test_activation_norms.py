"""activation_norms' own tests, written with ortcore.testing's fixtures as any plugin author would.

Norms are compared with torch's own (``torch.linalg.vector_norm`` on tensors captured by forward and tensor hooks),
and an ORTModule's rows with a plain-PyTorch run of the same model.
"""

from __future__ import annotations

import copy
import csv
import math
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import ortcore_activation_norms as plugin
from ortcore import ORTModule
from ortcore.api import OptionError, PluginError
from ortcore.hooks import GlobalSubscriberManager
from ortcore.host import set_host
from ortcore.testing import ACTIVATION_NET_NAMES, ActivationNet
from ortcore_activation_norms import COLUMNS, NormSubscriber
from ortcore_activation_norms import subscriber as subscriber_module

PLUGINS = {"activation_norms": plugin}
TORCH_RTOL = 1e-6  # our float64 norms against torch's float64 norms of the same tensors
ORT_RTOL = 1e-4  # ONNX Runtime's tensors against PyTorch's, for the same model and inputs
NAMES = ACTIVATION_NET_NAMES


@pytest.fixture
def subscribe():
    """``GlobalSubscriberManager.subscribe``, with every model unsubscribed after the test (even a failed one)."""
    models = []

    def subscribe(model, subscribers, host):
        models.append(model)
        GlobalSubscriberManager.subscribe(model, subscribers, host=host)

    yield subscribe
    for model in models:
        GlobalSubscriberManager.unsubscribe(model)


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.reader(f)
        assert tuple(next(reader)) == COLUMNS
        return [
            {"step": int(s), "order": int(o), "kind": k, "name": n, "numel": int(c), "l2": float(a), "rms": float(b), "max_abs": float(m)}
            for s, o, k, n, c, a, b, m in reader
        ]  # fmt: skip


def keyed(rows):
    """``(step, kind, name, call) -> row``; ``call`` numbers the calls of one name in a step."""
    calls, out = Counter(), {}
    for row in sorted(rows, key=lambda r: (r["step"], r["order"])):
        key = (row["step"], row["kind"], row["name"])
        out[(*key, calls[key])] = row
        calls[key] += 1
    return out


def capture(model, step_log):
    """Forward hooks on every submodule and tensor hooks on their outputs: (step, kind, name) -> tensor."""
    root = type(model).__name__

    def hook(path):
        def record(_module, _args, output):
            step = step_log["step"]
            for key, leaf in pytree.tree_flatten_with_path(output)[0]:
                if isinstance(leaf, torch.Tensor):
                    name = path + pytree.keystr(key)
                    step_log["tensors"][(step, "forward", name)] = leaf.detach().clone()
                    if leaf.requires_grad:
                        leaf.register_hook(
                            lambda g, n=name, s=step: step_log["tensors"].__setitem__(
                                (s, "backward", n), g.detach().clone()
                            )
                        )

        return record

    for path, module in model.named_modules():
        module.register_forward_hook(hook(path or root))


def expected_norms(tensor):
    t = tensor.double()
    return (
        torch.linalg.vector_norm(t).item(),
        t.square().mean().sqrt().item(),
        torch.linalg.vector_norm(t, ord=math.inf).item(),
    )


def train(model, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=generator)).square().mean().backward()
        optimizer.step()


def test_norms_equal_torch_vector_norm_of_every_output_and_gradient(subscribe, ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS)
    model = ActivationNet()
    log = {"step": 0, "tensors": {}}
    capture(model, log)
    subscribe(model, [NormSubscriber(tmp_path / "norms.csv")], host=host)
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        log["step"] = step
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=generator)).square().mean().backward()
        optimizer.step()
    GlobalSubscriberManager.unsubscribe(model)

    rows = read_rows(tmp_path / "norms.csv")
    # inspect_activation's tensor has no module hook: it is 2 * block.fc's output, so its gradient is half fc's.
    tensors = log["tensors"]
    for step in range(2):
        tensors[(step, "forward", "block.hidden")] = tensors[(step, "forward", "block.fc")] * 2
        tensors[(step, "backward", "block.hidden")] = tensors[(step, "backward", "block.fc")] / 2
    assert len(rows) == 2 * 2 * len(NAMES)
    assert (
        {(r["step"], r["kind"], r["name"]) for r in rows}
        == set(tensors)
        == {(s, k, n) for s in range(2) for k in ("forward", "backward") for n in NAMES}
    )
    for row in rows:
        tensor = tensors[(row["step"], row["kind"], row["name"])]
        assert row["numel"] == tensor.numel()
        l2, rms, max_abs = expected_norms(tensor)
        assert row["l2"] == pytest.approx(l2, rel=TORCH_RTOL), row
        assert row["rms"] == pytest.approx(rms, rel=TORCH_RTOL), row
        assert row["max_abs"] == pytest.approx(max_abs, rel=TORCH_RTOL), row
        assert row["l2"] > 0
    for step in range(2):  # one order sequence per step: forward outputs first, then gradients
        orders = sorted((r["order"], r["kind"]) for r in rows if r["step"] == step)
        assert [o for o, _ in orders] == list(range(2 * len(NAMES)))
        assert [k for _, k in orders] == ["forward"] * len(NAMES) + ["backward"] * len(NAMES)


def test_tensor_norms_of_special_tensors():
    values = torch.tensor([3.0, -4.0, 0.0])
    assert plugin.tensor_norms(values) == pytest.approx((5.0, 5.0 / math.sqrt(3), 4.0), rel=1e-12)
    assert plugin.tensor_norms(torch.tensor([1, -2], dtype=torch.int64)) == pytest.approx(
        (math.sqrt(5), math.sqrt(2.5), 2.0)
    )
    nan = plugin.tensor_norms(torch.tensor([1.0, float("nan")]))
    assert all(math.isnan(v) for v in nan)
    assert plugin.tensor_norms(torch.tensor([1.0, float("-inf")])) == (math.inf, math.inf, math.inf)
    l2, rms, max_abs = plugin.tensor_norms(torch.empty(0, 3))
    assert l2 == 0.0 and math.isnan(rms) and math.isnan(max_abs)
    half = torch.randn(1000, dtype=torch.bfloat16) * 1000
    assert plugin.tensor_norms(half)[0] == pytest.approx(torch.linalg.vector_norm(half.double()).item(), rel=1e-12)


@pytest.mark.parametrize("subscribed", ["before_wrapping", "after_wrapping"])
def test_ortmodule_rows_match_pytorch_run(subscribe, ortcore_host, tmp_path, subscribed):
    host = ortcore_host(PLUGINS)
    reference = ActivationNet()
    model = copy.deepcopy(reference)
    subscribe(reference, [NormSubscriber(tmp_path / "torch.csv", every=2)], host=host)
    ort_subscriber = NormSubscriber(tmp_path / "ort.csv", every=2)
    if subscribed == "before_wrapping":
        subscribe(model, [ort_subscriber], host=host)
        model = ORTModule(model, host=host)
    else:
        model = ORTModule(model, host=host)
        subscribe(model, [ort_subscriber], host=host)
    train(reference, 5)
    train(model, 5)
    GlobalSubscriberManager.unsubscribe(reference)
    GlobalSubscriberManager.unsubscribe(model)

    assert model.fallback_reason is None and ort_subscriber.engine == "ortcore"  # ORT's tensors, not torch's
    expected, actual = keyed(read_rows(tmp_path / "torch.csv")), keyed(read_rows(tmp_path / "ort.csv"))
    assert {k[0] for k in expected} == {0, 2, 4}
    assert {k[2] for k in expected} == NAMES
    assert actual.keys() == expected.keys()
    for key, row in expected.items():
        assert actual[key]["numel"] == row["numel"], key
        for column in ("l2", "rms", "max_abs"):
            assert actual[key][column] == pytest.approx(row[column], rel=ORT_RTOL), (key, column)


def test_start_end_and_every_choose_the_recorded_steps(subscribe, ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS)
    model = ActivationNet()
    subscribe(model, [NormSubscriber(tmp_path / "norms.csv", start_step=2, end_step=9, every=3)], host=host)
    train(model, 11)
    model.eval()
    model(torch.randn(2, 4))  # an eval forward is not a step
    GlobalSubscriberManager.unsubscribe(model)
    rows = read_rows(tmp_path / "norms.csv")
    assert sorted({r["step"] for r in rows}) == [2, 5, 8]
    assert Counter(r["step"] for r in rows) == {2: 2 * len(NAMES), 5: 2 * len(NAMES), 8: 2 * len(NAMES)}


def test_each_step_is_appended_in_one_write_when_the_next_starts(subscribe, ortcore_host, tmp_path, monkeypatch):
    host = ortcore_host(PLUGINS)
    writes = []
    real_write = os.write
    monkeypatch.setattr(subscriber_module.os, "write", lambda fd, data: writes.append(data) or real_write(fd, data))
    model = ActivationNet()
    path = tmp_path / "norms.csv"
    subscribe(model, [NormSubscriber(path)], host=host)
    train(model, 1)
    assert read_rows(path) == [] and writes == []  # step 0 may still get gradients: kept until it is over
    train(model, 1)  # step 1 starts: step 0 is written
    assert len(writes) == 1 and {r["step"] for r in read_rows(path)} == {0}
    assert len(read_rows(path)) == 2 * len(NAMES) == writes[0].count(b"\n")
    GlobalSubscriberManager.unsubscribe(model)  # ends step 1
    assert len(writes) == 2 and {r["step"] for r in read_rows(path)} == {0, 1}


def test_a_short_write_is_undone_and_raises(tmp_path, monkeypatch):
    path = tmp_path / "norms.csv"
    subscriber = NormSubscriber(path)
    subscriber.on_forward(0, 0, "a", torch.ones(3))
    subscriber.flush()
    before = path.read_bytes()
    subscriber.on_forward(1, 0, "a", torch.ones(3))
    subscriber.on_forward(1, 1, "b", torch.ones(3))
    real_write = os.write
    monkeypatch.setattr(subscriber_module.os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))
    with pytest.raises(OSError, match="wrote .* of .* bytes"):
        subscriber.flush()
    assert path.read_bytes() == before  # no half row left behind


def test_a_killed_process_leaves_whole_rows(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(plugin.__file__).parents[1])!r})
        from ortcore.hooks import GlobalSubscriberManager
        from ortcore.testing import make_host
        import ortcore_activation_norms as plugin

        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
        host = make_host({{"activation_norms": plugin}})
        GlobalSubscriberManager.subscribe(model, [plugin.NormSubscriber("norms.csv")], host=host)
        for step in range(3):
            model(torch.randn(8, 64)).sum().backward()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    (tmp_path / "train.py").write_text(script)
    killed = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    text = (tmp_path / "norms.csv").read_text()
    assert text.endswith("\n")
    rows = read_rows(tmp_path / "norms.csv")
    assert Counter(r["step"] for r in rows) == {0: 42, 1: 42}  # step 2 was not over yet; steps 0 and 1 are whole


def test_existing_file_needs_overwrite_and_is_kept_without_it(tmp_path):
    path = tmp_path / "norms.csv"
    path.write_text("mine\n")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        NormSubscriber(path)
    assert path.read_text() == "mine\n"
    NormSubscriber(path, overwrite=True)
    assert path.read_text() == ",".join(COLUMNS) + "\n"


def test_two_subscribed_models_cannot_share_a_file(subscribe, ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS)
    first = torch.nn.Linear(2, 2)
    subscribe(first, [NormSubscriber(tmp_path / "n.csv")], host=host)
    with pytest.raises(ValueError, match="being written for a subscribed model .Linear."):
        NormSubscriber(tmp_path / "n.csv", overwrite=True)
    GlobalSubscriberManager.unsubscribe(first)
    NormSubscriber(tmp_path / "n.csv", overwrite=True)  # free again


def test_one_subscriber_records_one_model(subscribe, ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS)
    subscriber = NormSubscriber(tmp_path / "n.csv")
    subscribe(torch.nn.Linear(2, 2), [subscriber], host=host)
    with pytest.raises(ValueError, match="records one model; .* already has Linear's rows"):
        subscribe(torch.nn.Tanh(), [subscriber], host=host)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, r"every=0 is not allowed; allowed: an integer >= 1"),
        ({"every": 1.5}, r"every=1.5 is not allowed"),
        ({"start_step": -1}, r"start_step=-1 is not allowed; allowed: None or an integer >= 0"),
        ({"end_step": 0}, r"end_step=0 is not allowed; allowed: None or an integer >= 1"),
        ({"start_step": 3, "end_step": 3}, r"end_step=3 must be greater than start_step=3"),
    ],
)
def test_bad_arguments_name_the_value_and_what_is_allowed(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        NormSubscriber(tmp_path / "n.csv", **kwargs)
    assert not (tmp_path / "n.csv").exists()


def test_bad_output_paths(tmp_path):
    with pytest.raises(ValueError, match="output_path='' is not allowed"):
        NormSubscriber("")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        NormSubscriber(tmp_path)
    with pytest.raises(TypeError, match="output_path=3 is not allowed"):
        NormSubscriber(3)
    NormSubscriber(tmp_path / "deeper" / "rank{rank}.csv")
    assert (tmp_path / "deeper" / "rank0.csv").is_file()


def test_subscriber_class_resolves_from_ortcore_hooks(ortcore_host):
    import ortcore.hooks

    previous = set_host(ortcore_host(PLUGINS))
    try:
        assert ortcore.hooks.NormSubscriber is NormSubscriber
        set_host(ortcore_host({}))  # the plugin not installed: the name is unknown
        with pytest.raises(AttributeError, match="NormSubscriber"):
            ortcore.hooks.NormSubscriber  # noqa: B018
    finally:
        set_host(previous)


def enabled_table(path, **options):
    return {"plugins": {"activation_norms": {"enabled": True, "output_path": str(path), **options}}}


def test_config_gives_every_subscribed_model_a_norm_subscriber(subscribe, ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS, table=enabled_table(tmp_path / "norms_{rank}.csv", every=2, end_step=4))
    model = ORTModule(ActivationNet(), host=host)
    subscribe(model, [], host=host)
    subscribe(model, [], host=host)  # subscribing again adds no second writer
    train(model, 5)
    GlobalSubscriberManager.unsubscribe(model)
    rows = read_rows(tmp_path / "norms_0.csv")
    assert Counter(r["step"] for r in rows) == {0: 2 * len(NAMES), 2: 2 * len(NAMES)}
    assert keyed(rows).keys() == {(s, k, n, 0) for s in (0, 2) for k in ("forward", "backward") for n in NAMES}


def test_config_off_by_default_and_when_disabled(subscribe, ortcore_host, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for table in ({}, {"plugins": {"activation_norms": {"enabled": False, "output_path": "norms.csv"}}}):
        host = ortcore_host(PLUGINS, table=table)
        model = ActivationNet()
        subscribe(model, [], host=host)
        train(model, 2)
        GlobalSubscriberManager.unsubscribe(model)
    assert os.listdir(tmp_path) == []


def test_config_from_environment(subscribe, ortcore_host, tmp_path):
    env = {"ORTCORE_ACTIVATION_NORMS_ENABLED": "1", "ORTCORE_ACTIVATION_NORMS_OUTPUT_PATH": str(tmp_path / "env.csv")}
    host = ortcore_host(PLUGINS, env=env)
    options = host.config.plugin_options("activation_norms")
    assert options.enabled and options.output_path == str(tmp_path / "env.csv") and options.every == 1
    model = torch.nn.Linear(2, 2)
    subscribe(model, [], host=host)
    model(torch.ones(1, 2)).sum().backward()
    GlobalSubscriberManager.unsubscribe(model)
    assert [(r["kind"], r["name"]) for r in read_rows(tmp_path / "env.csv")] == [
        ("forward", "Linear"),
        ("backward", "Linear"),
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"every": 0}, r"plugins\.activation_norms\.every=0 is not allowed; allowed: an integer >= 1"),
        ({"every": "often"}, r"plugins\.activation_norms\.every='often' is not allowed; allowed: an integer >= 1"),
        ({"start_step": -2}, r"plugins\.activation_norms\.start_step=-2 is not allowed; allowed: an integer >= 0"),
        ({"start_step": 5, "end_step": 2}, r"end_step=2 is not allowed; allowed: an integer greater than start_step=5"),
        ({"enabled": "sometimes"}, r"plugins\.activation_norms\.enabled='sometimes' is not a boolean; allowed: "),
        ({"output_path": ""}, r"plugins\.activation_norms\.output_path='' is not allowed; allowed: a non-empty file"),
        ({"output": "x.csv"}, r"unknown key 'plugins\.activation_norms\.output'.*Did you mean 'output_path'"),
    ],
)
def test_bad_option_values_name_the_value_and_what_is_allowed(ortcore_host, options, message):
    with pytest.raises(OptionError, match=message):
        ortcore_host(PLUGINS, table={"plugins": {"activation_norms": options}})


def test_config_file_exists_error_names_the_option(subscribe, ortcore_host, tmp_path):
    (tmp_path / "norms.csv").write_text("old\n")
    host = ortcore_host(PLUGINS, table=enabled_table(tmp_path / "norms.csv"))
    with pytest.raises(PluginError, match=r"activation_norms.*overwrite = true in \[plugins\.activation_norms\]"):
        subscribe(torch.nn.Linear(2, 2), [], host=host)
    assert (tmp_path / "norms.csv").read_text() == "old\n"
