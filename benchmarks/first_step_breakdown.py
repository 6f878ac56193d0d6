"""Where a cold first training step goes: import, plugin host, fingerprint, export, gradient build, session, runs.

    python benchmarks/first_step_breakdown.py [bert|gpt2]

Builds the model of ``ortcore bench``'s default config, wraps it in ``ORTModule`` and times one AdamW step, with the
build pipeline's stages timed separately (each stage's function is wrapped with a timer for this process only).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

# (module[:class], function, label): the stages timed, each by wrapping the function that does it.
STAGES = (
    ("ortcore.pipeline", "graph_description", "fingerprint (module digest included)"),
    ("torch.onnx", "export", "torch.onnx.export"),
    ("ortcore.pipeline", "export_graph", "export (torch.onnx.export + graph passes)"),
    ("ortcore.pipeline", "build_graph", "ORT gradient build"),
    ("ortcore.pipeline:Pipeline", "_run_gradient_graph_passes", "gradient-graph passes"),
    ("ortcore.pipeline:Pipeline", "_plan", "session plan"),
    ("ortcore.pipeline:Pipeline", "_create", "session creation"),
)


def stage_owner(path: str) -> Any:
    """``module`` or ``module:Class`` as the object whose attribute is wrapped."""
    import importlib

    module, _, cls = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, cls) if cls else owner


def _timed(owner: Any, attribute: str, label: str, into: dict[str, float]) -> None:
    function: Callable[..., Any] = getattr(owner, attribute)

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            into[label] = into.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, attribute, timed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="bert", choices=("bert", "gpt2"))
    args = parser.parse_args()

    import torch

    from ortcore_plugins.services.example_models import BenchConfig, build_model, make_batches

    cfg = BenchConfig()
    torch.manual_seed(cfg.seed)
    model = build_model(args.model, cfg)
    model.train()
    batch = make_batches(args.model, cfg)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    start = time.perf_counter()
    import torch.onnx  # noqa: F401

    import ortcore.pipeline  # noqa: F401

    imported = time.perf_counter() - start
    stages: dict[str, float] = {}
    for owner, attribute, label in STAGES:
        _timed(stage_owner(owner), attribute, label, stages)

    from ortcore import ORTModule

    t0 = time.perf_counter()
    wrapped = ORTModule(model)
    t1 = time.perf_counter()
    loss = wrapped(**batch).loss
    t2 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()

    ms = 1e3
    print(f"{args.model}: cold first step {(imported + t4 - t0) * ms:.0f} ms")
    print(f"  import of the export stack          {imported * ms:7.0f} ms")
    print(f"  ORTModule() (plugin host)           {(t1 - t0) * ms:7.0f} ms")
    print(f"  first forward                       {(t2 - t1) * ms:7.0f} ms, of which:")
    for label, seconds in stages.items():
        print(f"    {label:<44}{seconds * ms:7.0f} ms")
    print(f"  first backward                      {(t3 - t2) * ms:7.0f} ms")
    print(f"  optimizer step                      {(t4 - t3) * ms:7.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
