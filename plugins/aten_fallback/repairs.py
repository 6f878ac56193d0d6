"""The repairs this plugin offers (``ortcore_repairs``): an op the exporter failed on becomes an ATen node.

Op routing catches ops without any ONNX symbolic. An op *with* a symbolic can still fail for some inputs (a size the
symbolic needs static, a dtype it does not take, an attribute it cannot express): the exporter's error names the op,
and listing it in ``fallback_ops`` exports it as one ATen node run by PyTorch (forward, and backward through
``torch.autograd``), the smallest change that lets the rest of the model stay in ORT.
"""

from __future__ import annotations

import torch

from ortcore.config import Config
from ortcore.repair import Failure, Repair

from .options import NAME, fallback_ops


def repairs_for(config: Config, failure: Failure) -> list[Repair]:
    """One repair per ``aten::`` op the export failure names that PyTorch has and ``fallback_ops`` does not list."""
    if failure.stage != "export" or not failure.ops:
        return []
    listed = list(fallback_ops(config))
    repairs = []
    for op in failure.ops:
        name = op.rpartition("::")[2]
        if op in listed or not hasattr(torch.ops.aten, name):
            continue
        repairs.append(
            Repair(
                f"op {op} runs in PyTorch",
                plugin=NAME,
                options={"fallback_ops": [*listed, op]},
                kind="op",
                op=op,
            )
        )
    return repairs
