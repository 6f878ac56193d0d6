"""Reducing a gradient ``[B, S, H]`` over ``B, S`` (a bias gradient): ORT's ``ReduceSum``, a GEMV with ones, torch.

    python benchmarks/bias_reduction_bench.py [--runs 200]

ORT 1.19.2's gradient of a broadcasting ``Add`` over symbolic dimensions reduces with ``ReduceSum`` at axes computed at
run time; for a bias that is a real reduction, for the activation side a copy. This measures the real one three
ways per shape of the bench models: one-node ORT sessions (so ORT's columns include its ``run()`` overhead, about
20 us), ``MatMul(ones[1, B*S], dY[B*S, H])`` on ORT's MLAS, and ``torch.sum`` over the two leading dimensions. Minimum
and median of ``--runs`` after 10 warm-up runs, 2 threads each. The machine is named in the output.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

SHAPES = ((8, 128, 256), (8, 128, 1024), (4, 256, 768), (4, 256, 3072))  # default and large presets' linears


def _session(nodes: list, inputs: list, outputs: list, initializers: list) -> object:
    import onnx.helper as h
    import onnxruntime as ort

    model = h.make_model(
        h.make_graph(nodes, "g", inputs, outputs, initializers), opset_imports=[h.make_opsetid("", 17)]
    )
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _time(run: Callable[[], object], runs: int) -> tuple[float, float]:
    for _ in range(10):
        run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3, statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()

    import numpy as np
    import onnx.helper as h
    import torch
    from onnx import TensorProto

    from ortcore_plugins.services.machine import describe_machine, machine_line

    torch.set_num_threads(2)
    print(f"on {machine_line(describe_machine())}; ms, min / median of {args.runs}")
    print(f"{'shape':>16}  {'ORT ReduceSum':>15}  {'ORT ones @ dY':>15}  {'torch.sum':>15}")
    for batch, seq, hidden in SHAPES:
        x = np.random.default_rng(0).standard_normal((batch, seq, hidden), dtype=np.float32)
        x_info = h.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])
        y_info = h.make_tensor_value_info("y", TensorProto.FLOAT, None)
        axes = h.make_tensor("axes", TensorProto.INT64, [2], [0, 1])
        reduce = _session([h.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], [x_info], [y_info], [axes])
        shape = h.make_tensor("shape", TensorProto.INT64, [2], [-1, hidden])
        ones = h.make_tensor("ones", TensorProto.FLOAT, [1, batch * seq], [1.0] * (batch * seq))
        gemv = _session(
            [h.make_node("Reshape", ["x", "shape"], ["x2"]), h.make_node("MatMul", ["ones", "x2"], ["y"])],
            [x_info],
            [y_info],
            [shape, ones],
        )
        tensor = torch.from_numpy(x)
        columns = [
            _time(lambda s=reduce, feed={"x": x}: s.run(None, feed), args.runs),
            _time(lambda s=gemv, feed={"x": x}: s.run(None, feed), args.runs),
            _time(lambda t=tensor: t.sum((0, 1)), args.runs),
        ]
        cells = "  ".join(f"{lo:7.3f} / {mid:5.3f}" for lo, mid in columns)
        print(f"{str([batch, seq, hidden]):>16}  {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
