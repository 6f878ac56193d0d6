"""export_cache across processes, whatever the kernel-choice state of the graph a process ran: every graph is stored
(keyed by its state), a second process with the same model and inputs exports nothing, a truncated entry is rebuilt
into a usable one, and two processes storing the same key at once leave one whole entry.

Each process is a child Python (the default plugins, ``torch_kernels = "auto"``) training a Linear-Tanh-Linear with
SGD; it prints its counters (``exports``, ``cache_loads``) and its loss curve, which is checked against PyTorch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ortcore_plugins.export_cache as plugin

CHILD = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    from ortcore import ORTModule

    logging.basicConfig()
    logging.getLogger("ortcore.export_cache").setLevel(logging.INFO)
    steps, busy = int(sys.argv[1]), sys.argv[2] == "busy"
    if busy:  # every measurement counts as taken on a busy machine: provisional
        import ortcore_plugins.services.machine as machine
        machine.BUSY_PCT = -100.0
    torch.manual_seed(0)
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    losses, first = [], None
    for step in range(steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            c = model.state_machine.counters
            first = [c.exports, c.cache_loads]
    c = model.state_machine.counters
    print(json.dumps({"exports": c.exports, "cache_loads": c.cache_loads, "first": first, "losses": losses}))
    """
)


def reference_losses(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))


MODES = {  # name -> (ORTCORE_KERNEL_MEASURE, busy)
    "measuring on": ("later", False),
    "measuring off": ("off", False),
    "forced provisional": ("export", True),
}


def child_env(tmp_path: Path, measure: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    env.update(
        ORTMODULE_CACHE_DIR=str(tmp_path / "cache"),
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        ORTCORE_KERNEL_MEASURE=measure,
        ORTCORE_TORCH_KERNELS="auto",
    )
    return env


def start(tmp_path: Path, steps: int, mode: str) -> subprocess.Popen:
    measure, busy = MODES[mode]
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen(
        [sys.executable, str(script), str(steps), "busy" if busy else "idle"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(tmp_path, measure),
        cwd=tmp_path,
    )


def finish(proc: subprocess.Popen, steps: int) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    torch.testing.assert_close(result["losses"], reference_losses(steps), rtol=1e-4, atol=1e-6)
    return result, err


def run_child(tmp_path: Path, steps: int, mode: str) -> tuple[dict, str]:
    return finish(start(tmp_path, steps, mode), steps)


def graphs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache").glob(f"*{plugin.ENTRY_SUFFIX}"))


def check_second_process(tmp_path: Path, first_steps: int, second_steps: int, mode: str) -> None:
    first, _ = run_child(tmp_path, first_steps, mode)
    assert first["first"] == [1, 0]
    stored = graphs(tmp_path)
    assert len(stored) == 1, stored  # whatever its kernel-choice state, the graph the process ran is on file
    second, err = run_child(tmp_path, second_steps, mode)
    assert second["first"] == [1, 1], err  # the second process exports nothing: it loads the graph on file
    assert "export cache hit" in err


@pytest.mark.parametrize("mode", list(MODES))
def test_a_one_step_process_serves_the_next(tmp_path: Path, mode: str) -> None:
    check_second_process(tmp_path, 1, 2, mode)
    state = {"measuring on": ".deferred", "measuring off": "", "forced provisional": ".provisional"}[mode]
    assert [name.split(".rank0")[1] for name in graphs(tmp_path)] == [f"{state}{plugin.ENTRY_SUFFIX}"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_two_step_process_serves_a_one_step_process(tmp_path: Path, mode: str) -> None:
    check_second_process(tmp_path, 2, 1, mode)


@pytest.mark.slow
def test_a_process_that_measured_serves_its_final_graph(tmp_path: Path) -> None:
    """Five steps measure at step 2 (exporting again once if the measurement decided differently); what is on file
    afterwards serves the next process without an export."""
    first, _ = run_child(tmp_path, 5, "measuring on")
    assert first["exports"] - first["cache_loads"] <= 2
    second, err = run_child(tmp_path, 5, "measuring on")
    assert second["first"] == [1, 1], err
    assert second["exports"] - second["cache_loads"] <= 1  # at most once, if this process measures differently


def test_a_truncated_entry_is_logged_and_rebuilt_into_a_usable_one(tmp_path: Path) -> None:
    run_child(tmp_path, 1, "measuring on")
    [name] = graphs(tmp_path)
    path = tmp_path / "cache" / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    second, err = run_child(tmp_path, 1, "measuring on")
    assert second["first"] == [1, 0]  # exported again
    assert "is unusable" in err and "truncated" in err and str(path) in err, err
    assert graphs(tmp_path) == [name]
    fingerprint = name.split(".rank0")[0]
    graph = plugin.ExportCache(str(tmp_path / "cache")).load(model(), fingerprint, 0)
    assert graph is not None and plugin.state_of(graph) == "deferred"  # usable again


def test_two_processes_storing_the_same_key_at_once_leave_one_whole_entry(tmp_path: Path) -> None:
    procs = [start(tmp_path, 1, "measuring on") for _ in range(2)]
    results = [finish(p, 1)[0] for p in procs]
    assert all(r["exports"] == 1 for r in results)
    [name] = graphs(tmp_path)
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(plugin.TMP_SUFFIX)]
    assert leftovers == []
    fingerprint = name.split(".rank0")[0]
    assert plugin.ExportCache(str(tmp_path / "cache")).load(model(), fingerprint, 0) is not None


def test_the_final_graph_wins_and_supersedes_other_states(tmp_path: Path) -> None:
    """In one process: a deferred entry and then a final one of the same key; the final one is loaded, the other
    removed when the final one is stored."""
    run_child(tmp_path, 1, "measuring on")
    [name] = graphs(tmp_path)
    fingerprint = name.split(".rank0")[0]
    cache = plugin.ExportCache(str(tmp_path / "cache"))
    graph = cache.load(model(), fingerprint, 0)
    assert graph is not None and plugin.state_of(graph) == "deferred"
    cache.store(fingerprint, 0, graph, state=plugin.FINAL)
    assert graphs(tmp_path) == [f"{fingerprint}.rank0{plugin.ENTRY_SUFFIX}"]
    assert cache.candidates(fingerprint, 0)[0][0] == plugin.FINAL
    assert cache.load(model(), fingerprint, 0) is not None


def test_a_state_that_is_not_a_tag_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="state '../x' is not allowed"):
        plugin.ExportCache(str(tmp_path)).entry_path("0" * 64, 0, state="../x")
