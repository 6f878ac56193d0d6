"""activation_stats: per-step statistics of every activation and gradient, and the tools that compare two runs.

Record a PyTorch run and an ortcore run, then find the first activation where they part::

    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(output_dir="pt_out", override_output_dir=True)])

    ortcore find-divergence pt_out ort_out          # or find_divergence() from this package
    ortcore merge-activation-summary --pt_dir pt_out --ort_dir ort_out --output_dir summaries

The package, one module per part (docs/plugins/activation_stats.md, docs/convergence.md):

- ``records``: the record format (``FORMAT``, ``RECORD_FIELDS``, file names), without torch;
- ``subscriber``: :class:`StatisticsSubscriber`, which writes records in that format;
- ``merge_activation_summary``: reading and validating run directories; side-by-side text summaries per step;
- ``divergence``: the first divergence, the ranked table of the worst activations and the HTML report;
- ``commands``: the ``ortcore`` subcommands (a light module: ``ortcore --help`` imports it without torch).

Public names are imported on first use, so that loading this plugin (or its commands) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ortcore.api import hookimpl

from .commands import ortcore_commands

# name -> the module of this package that defines it, imported on first access (PEP 562)
_PUBLIC = {
    "StatisticsSubscriber": "subscriber",
    "tensor_statistics": "subscriber",
    "statistics_kernel_fused": "subscriber",
    "safe_name": "subscriber",
    "FORMAT": "records",
    "META_FILE": "records",
    "RECORDS_FILE": "records",
    "RECORD_FIELDS": "records",
    "KINDS": "records",
    "RecordError": "merge_activation_summary",
    "Run": "merge_activation_summary",
    "load_run": "merge_activation_summary",
    "resolve_runs": "merge_activation_summary",
    "merge": "merge_activation_summary",
    "find_divergence": "divergence",
    "write_html_report": "divergence",
    "plot_png": "divergence",
    "Report": "divergence",
}

__all__ = [*_PUBLIC, "ortcore_commands", "ortcore_register"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


@hookimpl
def ortcore_register(register: Any) -> None:
    from .subscriber import StatisticsSubscriber

    register.subscriber_class("StatisticsSubscriber", StatisticsSubscriber)
