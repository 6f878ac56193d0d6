"""``ortcore demo``: the demo plugin's command (light: no torch at import; the run imports it)."""

from __future__ import annotations

import argparse

from ortcore.api import hookimpl, positive_int


@hookimpl
def ortcore_commands(subparsers: argparse._SubParsersAction) -> None:
    _add_demo(subparsers)


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small model in PyTorch and in ortcore and compare the loss curves",
        description=(
            "Train a small seeded transformer-style model with AdamW twice, in plain PyTorch and wrapped in "
            "ortcore.ORTModule, from identical weights and data; print both loss curves and step times. "
            "Exits nonzero if the curves differ by more than the tolerance or ortcore fell back to PyTorch."
        ),
    )
    p.add_argument("--steps", type=positive_int, default=20, help="training steps per run (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default: 0)")
    p.set_defaults(run=_run_demo)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _run_demo(args: argparse.Namespace) -> int:
    from .run import DemoConfig, run_demo

    cfg = DemoConfig(steps=args.steps, seed=args.seed)
    print(
        f"ortcore demo: {cfg.steps} AdamW steps (lr {cfg.lr:g}) of a one-block transformer-style model "
        f"(dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab}), batch {cfg.batch} × seq {cfg.seq}, seed {cfg.seed}",
        flush=True,
    )
    print("training in PyTorch, then with ortcore.ORTModule from the same initial weights ...", flush=True)
    result = run_demo(cfg)
    print(f"model parameters: {result.n_params:,}\n")
    from ortcore.api import format_table

    rows = zip(
        result.torch_run.losses,
        result.ortcore_run.losses,
        result.rel_diffs,
        result.torch_run.step_times_s,
        result.ortcore_run.step_times_s,
    )
    notes = {1: "export + build + step"}
    for event in result.measurement:  # steps count from 0 there, from 1 here
        if event.measured:
            note = f"kernel measurement: {event.measured} case(s), {event.seconds * 1e3:.0f} ms"
            notes[event.step + 1] = "; ".join(filter(None, (notes.get(event.step + 1), note)))
    table = [
        (i, f"{a:.6f}", f"{b:.6f}", f"{d:.1e}", f"{ta * 1e3:.1f}", f"{tb * 1e3:.1f}", notes.get(i, ""))
        for i, (a, b, d, ta, tb) in enumerate(rows, 1)
    ]
    print(
        format_table(("step", "torch loss", "ortcore loss", "rel diff", "torch ms", "ortcore ms", ""), table, indent="")
    )
    print()
    if result.measurement_summary:
        print(result.measurement_summary)
        print()
    t, o = result.torch_run, result.ortcore_run
    if not result.ran_in_ort:
        verdict = f"FAIL: ortcore fell back to PyTorch ({result.fallback_reason})"
    elif result.passed:
        verdict = f"OK (limit {cfg.tolerance:.0e})"
    else:
        verdict = f"FAIL: curves differ by more than {cfg.tolerance:.0e}"
    print(
        f"summary: max rel loss diff {result.max_rel_diff:.1e} | first step: torch {_ms(t.first_step_s)}, "
        f"ortcore {_ms(o.first_step_s)} | median steady step: torch {_ms(t.steady_step_s)}, "
        f"ortcore {_ms(o.steady_step_s)} | {verdict}"
    )
    print(
        "note: a model this small mostly measures fixed per-step overheads; "
        "`ortcore bench` compares BERT and GPT-2 at realistic sizes."
    )
    return 0 if result.passed else 1
