"""A convergence investigation end to end, on a GPT-2 built from a config (no download).

    python docs/convergence_example.py --out /tmp/convergence [--perturb transformer.h.1.mlp.c_fc] [--from-step 3]

1. trains the model in PyTorch, recording statistics into ``<out>/pt_out``;
2. trains the same weights with ``ORTModule``, recording from ONNX Runtime's tensors into ``<out>/ort_out``; with
   ``--perturb``, from step ``--from-step`` on, a post-export graph pass scales that module's output by 1.01 inside
   the graph ORT runs (a real discrepancy, as a wrong kernel or a wrong export would make);
3. runs ``merge-activation-summary`` and ``find-divergence --html``, and saves the plot of the first divergent
   activation as ``<out>/first_divergence.png``.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import types

import onnx
import torch
import transformers

from ortcore import ORTModule
from ortcore.files import atomic_write
from ortcore.graph_passes import GraphPass
from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginHost, get_host
from ortcore_plugins.activation_stats import find_divergence, merge, plot_png, write_html_report

PERTURB: dict[str, object] = {"module": None}


def scale_module_output(model: onnx.ModelProto, context) -> None:
    """Multiply the output of the last node of the module ``PERTURB["module"]`` by 1.01."""
    module = PERTURB["module"]
    if module is None:
        return
    scope = "/module/" + re.sub(r"\.(?!\d)", "/", str(module)) + "/"  # transformer.h.1.mlp -> transformer/h.1/mlp
    nodes = list(model.graph.node)
    found = [i for i, n in enumerate(nodes) if n.name.startswith(scope) and n.op_type not in ("Constant", "Shape")]
    if not found:
        raise ValueError(f"no node of module {module!r} in the graph (scope {scope})")
    index = found[-1]
    out = nodes[index].output[0]
    nodes[index].output[0] = out + "_unscaled"
    scale = onnx.helper.make_node(
        "Constant", [], [out + "_scale"], value=onnx.helper.make_tensor("s", onnx.TensorProto.FLOAT, [], [1.01])
    )
    mul = onnx.helper.make_node("Mul", [out + "_unscaled", out + "_scale"], [out], name=f"{scope}perturbation")
    del model.graph.node[:]
    model.graph.node.extend([*nodes[: index + 1], scale, mul, *nodes[index + 1 :]])


def train(model, out_dir: str, steps: int, perturb: str | None = None, from_step: int = 0) -> list[float]:
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out_dir, override_output_dir=True)])
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        if perturb and step == from_step:
            PERTURB["module"] = perturb
            model.state_machine.reset(f"perturbing {perturb}")  # export again, now with the perturbing pass
        ids = torch.randint(0, 512, (4, 32), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    GlobalSubscriberManager.unsubscribe(model)
    PERTURB["module"] = None
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for pt_out, ort_out, summaries and the report")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--perturb", default=None, help="module whose output to scale inside ORT's graph")
    parser.add_argument("--from-step", type=int, default=3, help="first step that runs the perturbed graph")
    args = parser.parse_args(argv)

    config = transformers.GPT2Config(
        vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    baseline = transformers.GPT2LMHeadModel(config)
    candidate = copy.deepcopy(baseline)

    # The perturbing pass is a plugin like any other, registered on a host next to the installed ones.
    installed = get_host()
    perturber = types.SimpleNamespace(
        ortcore_graph_passes=hookimpl(lambda: [GraphPass("example_perturbation", run=scale_module_output)])
    )
    host = PluginHost(installed.config, plugins={"example_perturbation": perturber})

    pt_dir, ort_dir = os.path.join(args.out, "pt_out"), os.path.join(args.out, "ort_out")
    pt_losses = train(baseline, pt_dir, args.steps)
    # The gradient audit (on by default) would catch a perturbation on the first step of its graph and run the
    # module in PyTorch; this example shows the activation tools finding it, so the audit is off here.
    wrapped = ORTModule(candidate, host=host, verify_gradients=False)
    ort_losses = train(wrapped, ort_dir, args.steps, args.perturb, args.from_step)
    print("losses (pytorch, ortcore):")
    for step, (a, b) in enumerate(zip(pt_losses, ort_losses)):
        print(f"  step {step}: {a:.6f} {b:.6f}")

    merge(pt_dir, ort_dir, os.path.join(args.out, "summaries"))
    report = find_divergence(pt_dir, ort_dir)
    print(report.summary())
    write_html_report(report, os.path.join(args.out, "report.html"))
    if report.first is not None:
        series = next(s for s in report.series.values() if (s.kind, s.name) == (report.first.kind, report.first.name))
        atomic_write(os.path.join(args.out, "first_divergence.png"), plot_png(series, report.rtol))
    return 1 if report.diverged else 0


if __name__ == "__main__":
    raise SystemExit(main())
