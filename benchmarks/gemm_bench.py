"""Achieved GFLOP/s of the bench models' GEMMs, ONNX Runtime's (MLAS) against PyTorch's, and against the CPU's peak.

    python benchmarks/gemm_bench.py [--config default|large] [--runs 50]

Each shape is a linear layer of ``ortcore bench``'s BERT/GPT-2 at that preset, as the training step runs it: the
forward ``Y[M, N] = X[M, K] @ W[N, K]^T`` and the two backward GEMMs (``dX = dY @ W``, ``dW = dY^T @ X``), with
``M = batch * seq`` tokens. ORT runs each in a one-node session (``Gemm`` with the transposes as attributes, what ORT's
training graph runs), PyTorch with ``torch.mm`` on the same tensors; 2 threads each, minimum over ``--runs`` after
warm-up. The peak is cores x FLOP per cycle x clock, with FLOP per cycle from the ISA (AVX-512 with two FMA pipes:
64; Zen 4 runs 512-bit FMAs as two 256-bit halves: 32; AVX2 with two FMA pipes: 32) and the clock ``/proc/cpuinfo``
reports (the nominal one; boost is higher, so the real peak may be above it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def _shapes(config: str) -> list[tuple[str, int, int, int]]:
    from ortcore_plugins.services.example_models import preset

    cfg = preset(config)
    m, h = cfg.batch * cfg.seq, cfg.hidden
    shapes = []
    for name, k, n in (("qkv/out", h, h), ("ffn up", h, 4 * h), ("ffn down", 4 * h, h), ("lm head", h, cfg.vocab)):
        shapes += [(f"{name} fw", m, k, n), (f"{name} dX", m, n, k), (f"{name} dW", n, m, k)]
    return shapes  # (label, M, K, N): Y[M, N] = A[M, K] @ B[K, N]


def _clock_ghz() -> float | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1e3
    except (OSError, ValueError):
        pass
    return None


def _flop_per_cycle(machine: dict) -> int:
    if machine["isa"] in ("AVX-512", "AMX"):
        return 32 if "AMD" in machine["cpu"] else 64
    return 32 if machine["isa"] == "AVX2" else 16


def _best(run, runs: int) -> float:
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default", choices=("default", "large"))
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()

    import numpy as np
    import onnx.helper as h
    import onnxruntime as ort
    import torch
    from onnx import TensorProto

    from ortcore_plugins.services.machine import describe_machine, machine_line

    torch.set_num_threads(2)
    machine = describe_machine()
    clock = _clock_ghz()
    cores = machine["usable_cores"] or 1
    peak = cores * _flop_per_cycle(machine) * clock if clock else None
    print(f"on {machine_line(machine)}")
    print(
        f"nominal peak: {cores} cores x {_flop_per_cycle(machine)} FLOP/cycle x {clock:.2f} GHz = {peak:.0f} GFLOP/s "
        "(above 100% of it: the cores boost past the nominal clock)"
        if peak
        else "peak: clock unknown"
    )
    print(
        f"{'GEMM':>14} {'M':>6} {'K':>6} {'N':>6}  {'ORT GFLOP/s':>11} {'torch GFLOP/s':>13}  {'ORT / nominal peak':>18}"
    )
    rng = np.random.default_rng(0)
    for label, m, k, n in _shapes(args.config):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        graph = h.make_graph(
            [h.make_node("Gemm", ["a", "b"], ["y"])],
            "gemm",
            [
                h.make_tensor_value_info("a", TensorProto.FLOAT, [m, k]),
                h.make_tensor_value_info("b", TensorProto.FLOAT, [k, n]),
            ],
            [h.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        )
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
        model.ir_version = 8
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feed = {"a": a, "b": b}
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        flop = 2.0 * m * k * n
        ort_s = _best(lambda s=session, f=feed: s.run(None, f), args.runs)
        torch_s = _best(lambda x=ta, y=tb: torch.mm(x, y), args.runs)
        share = f"{100 * flop / ort_s / 1e9 / peak:.0f}%" if peak else "?"
        print(f"{label:>14} {m:6d} {k:6d} {n:6d}  {flop / ort_s / 1e9:11.1f} {flop / torch_s / 1e9:13.1f}  {share:>18}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
