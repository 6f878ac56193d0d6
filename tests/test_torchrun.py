"""docs/distributed_example.py under torchrun (2 CPU processes, gloo): DDP over an ORTModule with FusedAdam and the
load-balancing samplers trains as one PyTorch process does on the ranks' batches together, on one node and on two.

The reference is plain PyTorch (no ORTModule) with ``torch.optim.AdamW(fused=True)``, in this process. Each step it
runs one forward over the concatenation of the batches the ranks had at that step, padded to a common length, and
weighs each sample by ``1 / (world_size * its rank's batch size)``: the mean over the ranks of each rank's mean loss,
which is the gradient DDP's all-reduce averages. The load-balancing batches differ in size between ranks, so a
plain mean over the concatenated batch would not be that gradient; with equal batch sizes the two are the same.
Tolerance: every parameter within 1e-5 of the reference relative to the tensor's largest value (fp32).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "distributed_example.py"
STEPS = 14  # an epoch is 11 steps: the run crosses into the second epoch
SEED = 0
TOLERANCE = 1e-5
TIMEOUT = 180

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _example():
    spec = importlib.util.spec_from_file_location("distributed_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()


def _environment() -> dict[str, str]:
    # No ortcore option from the caller's shell changes the run; one thread per rank on a shared machine.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    env["OMP_NUM_THREADS"] = "1"
    # Bit-for-bit resumes need the same graph in every process (docs/distributed.md): a resumed process exports its
    # first batch's sizes (a static graph: bias gradients summed as GEMVs) where the uninterrupted run had gone
    # dynamic, and a kernel choice measured by an earlier run would route differently; both agree up to rounding.
    env["ORTCORE_DYNAMIC_SHAPES"] = "always"
    env["ORTCORE_KERNEL_MEASURE"] = "off"
    return env


def _torchrun(launcher_args: list[str], out: Path, *example_args: str, steps: int = STEPS) -> list[str]:
    """The command of one torchrun agent running the example."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        str(EXAMPLE),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--seed",
        str(SEED),
        *example_args,
    ]


def _wait(processes: list[subprocess.Popen]) -> list[str]:
    """Wait for every agent and return their outputs; fail with the outputs if one exits with an error or does not
    finish within ``TIMEOUT`` (then every agent is killed, with the workers it started)."""
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for agent in processes[len(outputs) :]:
                # The agent and its workers share the session the agent was started in.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
            outputs += [agent.communicate()[0] for agent in processes[len(outputs) :]]
            pytest.fail(f"torchrun did not finish within {TIMEOUT} s:\n" + "\n".join(outputs))
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, f"torchrun exited with {process.returncode}:\n{output}"
    return outputs


def _start(command: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _results(out: Path) -> dict:
    ranks = [torch.load(out / f"rank{rank}.pt") for rank in range(2)]
    # weights_only: the checkpoint holds tensors and builtins only (no ortcore class), as a plain PyTorch user needs.
    return {"ranks": ranks, "checkpoint": torch.load(out / "checkpoint.pt", weights_only=True)}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict:
    """``torchrun --standalone --nproc-per-node 2`` (a c10d rendezvous on a free local port)."""
    tmp = tmp_path_factory.mktemp("torchrun_one_node")
    out = tmp / "out"
    _wait([_start(_torchrun(["--standalone", "--nproc-per-node", "2"], out), tmp)])
    return _results(out)


def _reference(batches: list[list[list[int]]], steps: int) -> tuple[torch.nn.Module, list[float]]:
    """Plain PyTorch on the ranks' batches of each step together (see the module docstring): the model and the
    reference's loss per step (the mean of the per-rank mean losses, which is what DDP trains on)."""
    dataset = example.SequenceDataset(256, seed=SEED)
    model = example.build_model(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **example.OPTIMIZER_CONFIG)
    world_size = len(batches)
    losses = []
    for step in range(steps):
        indices = [i for rank in range(world_size) for i in batches[rank][step]]
        weights = torch.tensor(
            [1.0 / (world_size * len(batches[r][step])) for r in range(world_size) for _ in batches[r][step]]
        )
        batch = example.collate([dataset[i] for i in indices])
        per_sample = torch.nn.functional.cross_entropy(
            model(batch["ids"], batch["mask"]), batch["labels"], reduction="none"
        )
        loss = (per_sample * weights).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def _max_relative_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    assert actual.keys() == expected.keys()
    return {
        name: ((actual[name] - value).abs().max() / value.abs().max().clamp_min(1e-12)).item()
        for name, value in expected.items()
    }


def _assert_matches_reference(results: dict) -> None:
    ranks = results["ranks"]
    for rank in ranks:
        assert rank["fallback_reason"] is None
        # the first batch's sizes, then one graph more per dimension the load-balanced batches change (batch, length)
        assert rank["counters"]["exports"] <= 3 and rank["counters"]["fallbacks"] == 0
        assert len(rank["batches"]) == len(rank["losses"]) == STEPS
    model, losses = _reference([rank["batches"] for rank in ranks], STEPS)
    # What DDP trained on each step is the mean of the ranks' losses.
    ddp_losses = torch.tensor([sum(values) / len(values) for values in zip(*(rank["losses"] for rank in ranks))])
    torch.testing.assert_close(ddp_losses, torch.tensor(losses), rtol=TOLERANCE, atol=0)
    differences = _max_relative_difference(results["checkpoint"]["model"], model.state_dict())
    worst = max(differences, key=differences.get)
    assert differences[worst] <= TOLERANCE, f"{worst}: {differences[worst]:.2e} relative to the reference"
    # The all-reduced gradients keep the ranks' parameters identical.
    for name, value in ranks[0]["state"].items():
        torch.testing.assert_close(ranks[1]["state"][name], value, rtol=0, atol=0, msg=name)


def test_two_ranks_train_as_one_process_on_the_concatenated_batches(one_node):
    _assert_matches_reference(one_node)


def test_each_rank_gets_the_load_balanced_batches_of_its_rank(one_node):
    dataset = example.SequenceDataset(256, seed=SEED)
    seen = []
    for rank, result in enumerate(one_node["ranks"]):
        batch_sampler = example.make_batch_sampler(dataset, 2, rank, SEED, 512, 128)
        epochs = []
        for epoch in range(2):
            batch_sampler.set_epoch(epoch)
            epochs.append([list(batch) for batch in batch_sampler])
        assert result["batches"] == (epochs[0] + epochs[1])[:STEPS]
        seen.append({i for batch in epochs[0] for i in batch})
    assert not seen[0] & seen[1], "the ranks shared samples in the first epoch"
    # The batches differ in size between the ranks at some step: the reference's weighting is exercised.
    sizes = [[len(batch) for batch in result["batches"]] for result in one_node["ranks"]]
    assert sizes[0] != sizes[1]


def test_rank_0_checkpoint_loads_into_a_plain_pytorch_model(one_node):
    checkpoint = one_node["checkpoint"]
    assert checkpoint["step"] == STEPS
    plain = example.TextClassifier(**checkpoint["config"])
    plain.load_state_dict(checkpoint["model"], strict=True)
    for name, value in one_node["ranks"][0]["state"].items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=0, atol=0, msg=name)
    # The plain model computes what the trained ORTModule computed.
    probe = example.collate([example.SequenceDataset(256, seed=SEED)[i] for i in range(example.PROBE_SAMPLES)])
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            plain(probe["ids"], probe["mask"]), one_node["ranks"][0]["logits"], rtol=1e-5, atol=1e-6
        )
    # The optimizer state resumes a FusedAdam.
    optimizer = example.make_optimizer(plain.parameters())
    optimizer.load_state_dict(checkpoint["optimizer"])
    assert all(state["step"] == STEPS for state in optimizer.state.values())


@pytest.mark.slow
def test_two_nodes_on_this_machine_train_as_one_process(tmp_path):
    """Two torchrun agents, ``--nnodes 2 --nproc-per-node 1``, meeting at a c10d rendezvous on 127.0.0.1."""
    out = tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    agents = [_start(_torchrun([*launcher, "--rdzv-id", "test_two_nodes"], out), tmp_path) for _ in range(2)]
    _wait(agents)
    _assert_matches_reference(_results(out))


@pytest.mark.slow
def test_resuming_from_checkpoints_trains_the_same_weights(one_node, tmp_path):
    """7 steps, resumed to 11 (the end of the first epoch), resumed to 14: the weights and losses of one 14-step run,
    bit for bit (every rank loads the model and FusedAdam's state; the sampler skips the batches already done)."""
    losses, previous = [], None
    for steps in (7, 11, STEPS):
        out = tmp_path / f"to_{steps}"
        resume = ("--resume", str(previous / "checkpoint.pt")) if previous else ()
        _wait([_start(_torchrun(["--standalone", "--nproc-per-node", "2"], out, *resume, steps=steps), tmp_path)])
        rank0 = torch.load(out / "rank0.pt")
        assert rank0["batches"] == one_node["ranks"][0]["batches"][len(losses) : steps]
        losses += rank0["losses"]
        previous = out
    checkpoint = torch.load(previous / "checkpoint.pt")
    assert (checkpoint["step"], checkpoint["epoch"], checkpoint["batches_done"]) == (STEPS, 1, 3)
    assert losses == one_node["ranks"][0]["losses"]
    for name, value in one_node["checkpoint"]["model"].items():
        assert torch.equal(checkpoint["model"][name], value), name
