"""The activation_stats plugin's offline convergence tools: merge-activation-summary and find-divergence, on record
directories written here in the statistics record format (format 1) from real activations of a small model over 3
training steps."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ortcore_plugins.activation_stats import RecordError, find_divergence, merge, write_html_report
from ortcore_plugins.activation_stats.divergence import main as divergence_main
from ortcore_plugins.activation_stats.merge_activation_summary import main as merge_main

STEPS = (1, 2, 3)


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """find-divergence writes its HTML report into the current directory by default."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------------------------------- writer


def stats_record(name: str, kind: str, step: int, order: int, rank: int, t: torch.Tensor) -> dict:
    t = t.detach().float()
    finite = t[torch.isfinite(t)]
    return {
        "format": 1,
        "name": name,
        "kind": kind,
        "step": step,
        "order": order,
        "rank": rank,
        "shape": list(t.shape),
        "dtype": "float32",
        "numel": t.numel(),
        "min": finite.min().item() if finite.numel() else None,
        "max": finite.max().item() if finite.numel() else None,
        "mean": finite.mean().item() if finite.numel() else None,
        "std": finite.std().item() if finite.numel() > 1 else 0.0,
        "abs_mean": finite.abs().mean().item() if finite.numel() else None,
        "zeros": int((t == 0).sum()),
        "nans": int(torch.isnan(t).sum()),
        "infs": int(torch.isinf(t).sum()),
        "samples": t.flatten()[:8].tolist(),
    }


def write_run(root: Path, steps: dict[int, list[dict]], source: str = "torch", rank: int = 0, world_size: int = 1):
    root.mkdir(parents=True, exist_ok=True)
    meta = {"format": 1, "source": source, "rank": rank, "world_size": world_size, "model": "TinyNet"}
    (root / "meta.json").write_text(json.dumps(meta))
    for step, records in steps.items():
        d = root / f"step_{step}"
        d.mkdir(exist_ok=True)
        for rec in records:
            rec = {**rec, "rank": rank}
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", rec["name"])
            (d / f"{rec['order']:05d}_{rec['kind']}_{safe}.json").write_text(json.dumps(rec))
    return root


def collect(perturb: str | None = None, from_step: int = 2, factor: float = 1.05) -> dict[int, list[dict]]:
    """Train a small model 3 steps, recording each submodule's output (forward) and its gradient (backward) in
    execution order; ``perturb`` scales one submodule's output from ``from_step`` on (what a kernel bug looks like)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(6, 16))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("fc2", torch.nn.Linear(16, 8))
    model.add_module("head", torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 6)
    target = torch.randn(4, 3)
    out: dict[int, list[dict]] = {}
    state = {"step": 0, "order": 0}

    def record(name, kind, t):
        out[state["step"]].append(stats_record(name, kind, state["step"], state["order"], 0, t))
        state["order"] += 1

    def hook(name):
        def fn(_m, _a, y):
            if name == perturb and state["step"] >= from_step:
                y = y * factor
            record(name, "forward", y)
            y.register_hook(lambda g: record(name, "backward", g))
            return y

        return fn

    for n, m in model.named_children():
        m.register_forward_hook(hook(n))
    for step in STEPS:
        state.update(step=step, order=0)
        out[step] = []
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        opt.step()
    return out


@pytest.fixture(scope="module")
def reference() -> dict[int, list[dict]]:
    return collect()


@pytest.fixture(scope="module")
def perturbed() -> dict[int, list[dict]]:
    return collect(perturb="fc2")


# ---------------------------------------------------------------------------------------------------- divergence


def test_identical_runs_report_no_divergence(tmp_path, reference, capsys):
    pt = write_run(tmp_path / "pt_out", reference)
    ort = write_run(tmp_path / "ort_out", collect(), source="ortcore")
    report = find_divergence(pt, ort)
    assert not report.diverged and report.first is None
    assert report.steps == [1, 2, 3] and report.compared == 3 * 8
    assert report.worst == []
    assert divergence_main([str(pt), str(ort)]) == 0
    assert "no divergence" in capsys.readouterr().out


def test_perturbed_activation_is_first_divergence(tmp_path, reference, perturbed, capsys):
    pt = write_run(tmp_path / "pt_out", reference)
    ort = write_run(tmp_path / "ort_out", perturbed, source="ortcore")
    report = find_divergence(pt, ort)
    first = report.first
    assert first is not None
    assert (first.step, first.kind, first.name, first.order) == (2, "forward", "fc2", 2)
    stats = {m.stat for m in first.mismatches}
    assert {"mean", "abs_mean", "std"} <= stats and "nans" not in stats
    m = next(m for m in first.mismatches if m.stat == "abs_mean")
    assert m.ort == pytest.approx(m.pt * 1.05, rel=1e-5)
    # everything at step 1 agrees; upstream fc1/act agree at step 2 and differ at step 3 (after the update)
    firsts = {(s.kind, s.name): s.first_divergent_step for s in report.worst}
    assert firsts[("forward", "fc2")] == firsts[("forward", "head")] == firsts[("backward", "fc1")] == 2
    assert firsts[("forward", "fc1")] == firsts[("forward", "act")] == 3

    assert divergence_main([str(pt), str(ort), "--top", "3"]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 2" in out and "'fc2'" in out
    assert "abs_mean" in out and "worst activations (top 3" in out


def test_ranked_table_orders_by_max_relative_difference(tmp_path, reference):
    ort_steps = copy.deepcopy(reference)
    by_name = {(r["kind"], r["name"]): r for r in ort_steps[3]}
    for (kind, name), factor in [(("forward", "act"), 1.01), (("backward", "fc1"), 1.5), (("forward", "head"), 1.2)]:
        rec = by_name[(kind, name)]
        rec["abs_mean"] = rec["abs_mean"] * factor
    pt = write_run(tmp_path / "pt_out", reference)
    ort = write_run(tmp_path / "ort_out", ort_steps, source="ortcore")
    report = find_divergence(pt, ort, top=2)
    assert [(s.kind, s.name) for s in report.worst] == [("backward", "fc1"), ("forward", "head")]
    assert report.worst[0].max_rel == pytest.approx(0.5) and report.worst[0].worst_stat == "abs_mean"
    assert report.worst[0].worst_step == 3
    # first divergence is the earliest in execution order at step 3, not the worst one
    assert (report.first.step, report.first.name, report.first.kind) == (3, "act", "forward")
    # within tolerance: no divergence, but the difference still ranks
    loose = find_divergence(pt, ort, rtol=0.6)
    assert not loose.diverged and len(loose.worst) == 3


def test_nan_counts_shapes_and_missing_activations_diverge(tmp_path, reference):
    pt = write_run(tmp_path / "pt_out", reference)
    for change, stat in [("nans", "nans"), ("shape", "shape"), ("drop", "present")]:
        ort_steps = copy.deepcopy(reference)
        rec = ort_steps[1][3]
        if change == "nans":
            rec["nans"] = 1
        elif change == "shape":
            rec["shape"] = [2, 16]
        else:
            del ort_steps[1][3]
        ort = write_run(tmp_path / f"ort_{change}", ort_steps, source="ortcore")
        report = find_divergence(pt, ort)
        assert report.first.step == 1 and report.first.order == 3
        assert stat in {m.stat for m in report.first.mismatches}
        assert math.isinf(report.worst[0].max_rel)


def test_html_report(tmp_path, reference, perturbed):
    pt = write_run(tmp_path / "pt_out", reference)
    ort = write_run(tmp_path / "ort_out", perturbed, source="ortcore")
    html_path = tmp_path / "report" / "div.html"
    assert divergence_main([str(pt), str(ort), "--top", "2", "--html", str(html_path)]) == 1
    text = html_path.read_text()
    assert "First divergence" in text and "fc2" in text
    assert text.count('<img alt="') == 2 and "data:image/png;base64," in text
    same = write_html_report(find_divergence(pt, pt), tmp_path / "same.html")
    assert "No divergence" in same.read_text() and "<img" not in same.read_text()
    assert not list(tmp_path.rglob("*.tmp"))  # written atomically, nothing left behind


def test_html_report_is_written_by_default_and_its_path_printed(tmp_path, reference, perturbed, capsys):
    pt = write_run(tmp_path / "runs" / "pt_out", reference)
    ort = write_run(tmp_path / "runs" / "ort out", perturbed, source="ortcore")
    assert divergence_main([str(pt), str(ort), "--top", "1"]) == 1
    expected = tmp_path / "divergence_pt_out_vs_ort_out.html"  # the current directory, names made file-safe
    assert f"HTML report: {expected}" in capsys.readouterr().out
    assert "First divergence" in expected.read_text() and expected.read_text().count("<img") == 1
    expected.unlink()
    assert divergence_main([str(pt), str(ort), "--no-html"]) == 1
    assert "HTML report" not in capsys.readouterr().out
    assert not list(tmp_path.glob("*.html"))


def test_html_path_and_no_html_exclude_each_other(tmp_path, reference, capsys):
    pt = write_run(tmp_path / "pt_out", reference)
    with pytest.raises(SystemExit) as info:
        divergence_main([str(pt), str(pt), "--no-html", "--html", "x.html"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_html_report_without_matplotlib_says_how_to_get_plots(tmp_path, reference, perturbed, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    pt = write_run(tmp_path / "pt_out", reference)
    ort = write_run(tmp_path / "ort_out", perturbed, source="ortcore")
    text = write_html_report(find_divergence(pt, ort), tmp_path / "r.html").read_text()
    assert "First divergence" in text and "<img" not in text and "pip install matplotlib" in text


def test_unwritable_html_path_is_a_bad_input_error(tmp_path, reference, capsys):
    pt = write_run(tmp_path / "pt_out", reference)
    (tmp_path / "file").write_text("")
    assert divergence_main([str(pt), str(pt), "--html", str(tmp_path / "file" / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the HTML report" in err and "file/r.html" in err


# ---------------------------------------------------------------------------------------------------- merge


def test_merge_writes_side_by_side_step_files(tmp_path, reference, perturbed, capsys):
    pt = write_run(tmp_path / "pt_out", reference)
    ort_steps = copy.deepcopy(perturbed)
    del ort_steps[3][1]  # "act" forward missing on the ORT side at step 3
    ort = write_run(tmp_path / "ort_out", ort_steps, source="ortcore")
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "step_1.txt").write_text("stale")
    written = merge(pt, ort, out)
    assert sorted(p.name for p in written) == ["step_1.txt", "step_2.txt", "step_3.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*"))
    step1 = (out / "step_1.txt").read_text()
    assert "stale" not in step1 and "pt.mean" in step1 and "ort.mean" in step1 and "rdiff.mean" in step1
    body = [line for line in step1.splitlines() if line and not line.startswith("#")][1:]
    assert [line.split()[2] for line in body] == [r["name"] for r in reference[1]]  # execution order
    assert all(line.split()[-4:] == ["0.000e+00"] * 4 for line in body)
    step3 = (out / "step_3.txt").read_text()
    assert "only in pytorch" in step3 and "act" in step3
    fc2 = next(line for line in (out / "step_2.txt").read_text().splitlines() if " forward " in line and "fc2" in line)
    assert float(fc2.split()[-4]) == pytest.approx(0.05, rel=1e-4)  # rdiff.mean

    assert merge_main(["--pt_dir", str(pt), "--ort_dir", str(ort), "--output_dir", str(tmp_path / "m2")]) == 0
    assert (tmp_path / "m2" / "step_2.txt").exists()
    assert "wrote 3 summary file(s)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- ranks


def _two_ranks(tmp_path: Path, reference, perturbed, layout: str):
    if layout == "dirs":
        pt = [write_run(tmp_path / f"pt_out_{r}", reference, rank=r, world_size=2) for r in (0, 1)]
        ort = [
            write_run(tmp_path / f"ort_out_{r}", reference if r == 0 else perturbed, "ortcore", r, 2) for r in (0, 1)
        ]
        return [str(p) for p in pt], [str(p) for p in ort]
    for r in (0, 1):
        write_run(tmp_path / "pt" / f"rank_{r}", reference, rank=r, world_size=2)
        write_run(tmp_path / "ort" / f"rank_{r}", reference if r == 0 else perturbed, "ortcore", r, 2)
    return tmp_path / "pt", tmp_path / "ort"


@pytest.mark.parametrize("layout", ["dirs", "parent"])
def test_ranks(tmp_path, reference, perturbed, layout):
    pt, ort = _two_ranks(tmp_path, reference, perturbed, layout)
    report = find_divergence(pt, ort)
    assert report.ranks == [0, 1]
    assert (report.first.rank, report.first.step, report.first.name) == (1, 2, "fc2")
    assert all(s.rank == 1 for s in report.worst)
    out = tmp_path / "merged"
    written = merge(pt, ort, out)
    assert len(written) == 6
    assert "rank 1" in (out / "rank_1" / "step_2.txt").read_text()
    assert (out / "rank_0" / "step_3.txt").exists()


def test_rank_prefix_of_sibling_dirs(tmp_path, reference, perturbed):
    _two_ranks(tmp_path, reference, perturbed, "dirs")
    report = find_divergence(tmp_path / "pt_out", tmp_path / "ort_out")
    assert report.ranks == [0, 1] and report.first.rank == 1


def test_rank_mismatch_is_an_error(tmp_path, reference):
    pt = [write_run(tmp_path / f"pt_{r}", reference, rank=r, world_size=2) for r in (0, 1)]
    ort = write_run(tmp_path / "ort_0", reference, "ortcore")
    with pytest.raises(RecordError, match="ranks"):
        find_divergence(pt, ort)


# ---------------------------------------------------------------------------------------------------- bad input


def _bad_inputs(tmp_path: Path, reference) -> dict[str, tuple[Path, Path, str]]:
    """case -> (directory to pass, path the error must name, words the error must contain)."""
    cases = {}
    missing = tmp_path / "nope"
    cases["missing dir"] = (missing, missing, "not found")

    empty = write_run(tmp_path / "empty", {})
    cases["no steps"] = (empty, empty, "no step_<N>/ folders")

    no_meta = write_run(tmp_path / "no_meta", reference)
    (no_meta / "meta.json").unlink()
    cases["no meta"] = (no_meta, no_meta / "meta.json", "file not found")

    other = write_run(tmp_path / "other_format", reference)
    rec_path = sorted((other / "step_2").glob("*.json"))[1]
    rec = json.loads(rec_path.read_text())
    rec_path.write_text(json.dumps({**rec, "format": 2}))
    cases["other format"] = (other, rec_path, '"format": 1')

    bad_json = write_run(tmp_path / "bad_json", reference)
    rec_path = sorted((bad_json / "step_3").glob("*.json"))[0]
    rec_path.write_text('{"format": 1, "name": ')
    cases["malformed JSON"] = (bad_json, rec_path, "malformed JSON")

    fields = write_run(tmp_path / "fields", reference)
    rec_path = sorted((fields / "step_1").glob("*.json"))[0]
    rec = json.loads(rec_path.read_text())
    del rec["std"]
    rec_path.write_text(json.dumps(rec))
    cases["missing field"] = (fields, rec_path, "missing field(s) std")

    bad_line = write_run(tmp_path / "bad_line", reference)
    lines_path = bad_line / "step_2" / "records.jsonl"
    lines_path.write_text(json.dumps({**reference[2][0], "rank": 0}) + "\n" + '{"format": 1, "name": \n')
    cases["malformed records.jsonl line"] = (bad_line, lines_path, "malformed JSON at line 2")
    return cases


def test_bad_input_errors_name_the_path(tmp_path, reference, capsys):
    good = write_run(tmp_path / "good", reference)
    for case, (given, named, words) in _bad_inputs(tmp_path, reference).items():
        with pytest.raises(RecordError) as info:
            find_divergence(good, given)
        assert str(named) in str(info.value) and words in str(info.value), case
        with pytest.raises(RecordError):
            merge(given, good, tmp_path / "out")
        assert divergence_main([str(good), str(given)]) == 2, case
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(named) in err, case
        assert merge_main(["--pt_dir", str(given), "--ort_dir", str(good), "--output_dir", str(tmp_path / "o")]) == 2
        capsys.readouterr()
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------- collector


def test_records_written_by_the_collector(tmp_path):
    """End to end with the real StatisticsSubscriber, when the plugin providing it is installed."""
    import ortcore.hooks as hooks

    try:
        statistics_subscriber = hooks.StatisticsSubscriber
    except AttributeError:
        pytest.skip("StatisticsSubscriber is not available in this environment")

    def run(out: Path, scale: float = 1.0) -> Path:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        hooks.GlobalSubscriberManager.subscribe(model, [statistics_subscriber(output_dir=str(out))])
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(3, 4)
            for step in range(3):
                opt.zero_grad()
                model(x * (scale if step == 1 else 1.0)).square().mean().backward()
                opt.step()
        finally:
            hooks.GlobalSubscriberManager.unsubscribe(model)
        return out

    a, b, c = run(tmp_path / "a"), run(tmp_path / "b"), run(tmp_path / "c", scale=1.1)
    assert not find_divergence(a, b).diverged
    report = find_divergence(a, c)
    assert report.first.step == 1 and report.first.order == 0
    assert len(merge(a, c, tmp_path / "merged")) == 3


def test_ortcore_command_runs_both_tools(tmp_path, reference, perturbed, capsys):
    from ortcore.cli import main

    write_run(tmp_path / "pt", reference)
    write_run(tmp_path / "ort", perturbed, source="ortcore")
    assert main(["find-divergence", str(tmp_path / "pt"), str(tmp_path / "pt")]) == 0
    assert f"HTML report: {tmp_path / 'divergence_pt_vs_pt.html'}" in capsys.readouterr().out
    assert main(["find-divergence", str(tmp_path / "pt"), str(tmp_path / "ort"), "--html", str(tmp_path / "r.html")]) == 1
    assert "fc2" in capsys.readouterr().out and (tmp_path / "r.html").is_file()
    args = ["merge-activation-summary", "--pt_dir", str(tmp_path / "pt"), "--ort_dir", str(tmp_path / "ort")]
    assert main([*args, "--output_dir", str(tmp_path / "merged")]) == 0
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["step_1.txt", "step_2.txt", "step_3.txt"]


def test_former_module_paths_still_work(tmp_path, reference, perturbed):
    """``ortcore.hooks.divergence`` / ``ortcore.hooks.merge_activation_summary``: imports and ``python -m``."""
    import ortcore.hooks.divergence as old_divergence
    import ortcore.hooks.merge_activation_summary as old_merge

    assert old_divergence.find_divergence is find_divergence and old_merge.merge is merge
    assert old_merge.RecordError is RecordError
    pt = write_run(tmp_path / "pt", reference)
    ort = write_run(tmp_path / "ort", perturbed, source="ortcore")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    found = subprocess.run(
        [sys.executable, "-m", "ortcore.hooks.divergence", str(pt), str(ort), "--no-html"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert found.returncode == 1, found.stderr
    assert "first divergence: step 2" in found.stdout
    merged = subprocess.run(
        [sys.executable, "-m", "ortcore.hooks.merge_activation_summary", "--pt_dir", str(pt), "--ort_dir", str(ort),
         "--output_dir", str(tmp_path / "m")],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["step_1.txt", "step_2.txt", "step_3.txt"]
