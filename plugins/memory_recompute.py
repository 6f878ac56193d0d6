"""memory_recompute: trade compute for memory by recomputing activations in backward instead of keeping them.

ONNX Runtime's memory optimizer finds subgraphs whose outputs are kept from forward to backward ("stashed
activations") and can be recomputed cheaply in backward instead. Each such subgraph is a *cluster*, named by its op
types (``Gelu+``, ``FusedMatMul+Add+``, ``LayerNormalization+``...). This plugin tells ORT which clusters to
recompute, as upstream ORTModule's ``ORTMODULE_MEMORY_OPT_LEVEL`` and ``ORTMODULE_MEMORY_OPT_CONFIG`` did::

    [plugins.memory_recompute]
    level = 1                          # env ORTMODULE_MEMORY_OPT_LEVEL
    config = ["BiasGelu+:1:-1"]        # env ORTMODULE_MEMORY_OPT_CONFIG (JSON list, comma list or JSON file)

- ``level = 0``: recompute only the clusters listed in ``config``.
- ``level = 1``: recompute every cluster ORT finds, within transformer layers (strategy 1, "recompute").
- ``level = 2``: as 1, plus clusters that can only be recomputed with a compromise (strategy 2).
- ``config`` entries are ``"<cluster id>:<strategy 0|1|2>:<count|-1>"``: strategy 0 leaves the cluster alone,
  count is how many occurrences to recompute (-1: all, 0: none). At level 1 or 2 they override what the level chose
  for the same cluster.

How: in the session plan of a training graph (``ortcore_session_plan``), the plugin asks a probe session's
``TrainingAgent.get_serialized_ortmodule_memory_stat`` for the recompute opportunities of that graph, picks the plan,
and adds the session config entries ``optimization.memory_optimizer_config`` (a JSON file with the plan) and
``optimization.enable_memory_probe_recompute_config`` with ORT's memory-efficient execution order to the plan, as
settings the session gets if ORT accepts them. The core then creates the session once. At ``log_level = "INFO"`` the opportunities are logged as a table, with
each plan ON or OFF, even when recompute is off. With ``save_onnx`` the graph ORT really runs (recompute nodes are
named ``..._recompute``) is saved as ``<prefix>_execution_model_training.onnx``.

Run ``python benchmarks/memory_recompute_bench.py`` to measure peak memory with and without recompute.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import attrs
import onnxruntime

from ortcore.api import LogLevel, OptionError, hookimpl, option

NAME = "memory_recompute"
logger = logging.getLogger("ortcore.memory_recompute")

LEVELS = {
    0: "USER_SPECIFIED",
    1: "TRANSFORMER_LAYERWISE_RECOMPUTE",
    2: "TRANSFORMER_LAYERWISE_RECOMPUTE_WITH_COMPROMISE",
}
CONFIG_ENTRY = "optimization.memory_optimizer_config"
PROBE_ENTRY = "optimization.enable_memory_probe_recompute_config"
# "<probe level>:<use transformer layers as boundaries>", as upstream: layer boundaries for the layer-wise levels.
PROBE_USER, PROBE_LAYERWISE = "1:0", "1:1"


# -- options -------------------------------------------------------------------------------------------------------


@attrs.frozen
class RecomputeEntry:
    """One ``<cluster id>:<strategy>:<count>`` entry of the memory optimizer's configuration."""

    cluster: str
    strategy: int
    count: int

    def __str__(self) -> str:
        return f"{self.cluster}:{self.strategy}:{self.count}"

    @property
    def active(self) -> bool:
        return self.strategy > 0 and self.count != 0

    @classmethod
    def parse(cls, text: str, source: str) -> RecomputeEntry:
        """Parse one entry; the error names it and says what is expected."""

        def bad(why: str) -> OptionError:
            return OptionError(
                f"{source}: entry {text!r} is not '<cluster id>:<strategy 0|1|2>:<count|-1>' ({why}); "
                "e.g. 'BiasGelu+:1:1'"
            )

        parts = text.strip().rsplit(":", 2)
        if len(parts) != 3:
            raise bad("it needs three fields separated by ':'")
        cluster, strategy, count = (p.strip() for p in parts)
        if not cluster or ":" in cluster:
            raise bad("the cluster id is empty" if not cluster else "the cluster id contains ':'")
        if strategy not in ("0", "1", "2"):
            raise bad(f"strategy {strategy!r} is not 0, 1 or 2")
        if not re.fullmatch(r"-1|\d+", count):
            raise bad(f"count {count!r} is not an integer >= -1")
        return cls(cluster, int(strategy), int(count))


def parse_level(value: object, source: str) -> int:
    """0, 1 or 2, or the level's upstream name (``TRANSFORMER_LAYERWISE_RECOMPUTE``...)."""
    if isinstance(value, int) and not isinstance(value, bool) and value in LEVELS:
        return value
    if isinstance(value, str):
        text = value.strip().upper()
        if text in ("0", "1", "2"):
            return int(text)
        names = {name: level for level, name in LEVELS.items()}
        if text in names:
            return names[text]
    allowed = ", ".join(f"{level} ({name})" for level, name in LEVELS.items())
    raise OptionError(f"{source}={value!r} is not a memory optimization level; allowed: {allowed}")


def parse_config(value: object, source: str) -> tuple[RecomputeEntry, ...]:
    """A list of entries from a TOML list, a JSON list, a comma-separated list, or the path of a JSON file.

    Upstream let one list item hold several entries joined by commas (a combined plan); those are split too.
    """
    if isinstance(value, tuple) and all(isinstance(v, RecomputeEntry) for v in value):
        return value
    if isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, str):
        text = value.strip()
        if not text:
            return ()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                raise OptionError(f"{source}={value!r} is not a valid JSON list: {e}") from e
        elif os.path.isfile(text) or text.lower().endswith(".json"):
            items = _read_config_file(text, source)
        else:
            items = [text]
    else:
        raise OptionError(f"{source}={value!r} must be a list of '<cluster id>:<strategy>:<count>' strings")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise OptionError(f"{source}={value!r} must be a list of '<cluster id>:<strategy>:<count>' strings")
    return tuple(RecomputeEntry.parse(part, source) for item in items for part in item.split(",") if part.strip())


def _read_config_file(path: str, source: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise OptionError(f"{source}={path!r}: no such file (expected a JSON list of recompute entries)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise OptionError(f"{source}={path!r}: cannot read a JSON list from it: {e}") from e
    if not isinstance(data, list):
        raise OptionError(f"{source}={path!r} must hold a JSON list of strings, not {type(data).__name__}")
    return data


@attrs.frozen
class MemoryRecomputeOptions:
    """Options of ``[plugins.memory_recompute]``, with upstream's environment variables."""

    level: int = option(
        0,
        parse_level,
        "0 = recompute what `config` lists, 1 = every cluster within transformer layers, 2 = also with compromise",
        env="ORTMODULE_MEMORY_OPT_LEVEL",
    )
    config: tuple[RecomputeEntry, ...] = option(
        (),
        parse_config,
        "recompute entries '<cluster id>:<strategy 0|1|2>:<count|-1>' (JSON list, comma list or JSON file)",
        env="ORTMODULE_MEMORY_OPT_CONFIG",
    )

    @property
    def enabled(self) -> bool:
        return self.level > 0 or any(e.active for e in self.config)

    @property
    def probe_config(self) -> str:
        return PROBE_LAYERWISE if self.level > 0 else PROBE_USER


def _options(config: Any) -> MemoryRecomputeOptions:
    return config.plugin_options(NAME) or MemoryRecomputeOptions()


# -- planning ----------------------------------------------------------------------------------------------------


@attrs.frozen
class Opportunity:
    """A recompute plan ORT found: its cluster entries, how often it occurs, and the bytes it saves (symbolic)."""

    plan: str  # one or more entries joined by ',' (ORT's cluster id combination)
    frequency: int
    saving: str  # ORT's symbolic expression, in bytes

    @property
    def entries(self) -> list[RecomputeEntry]:
        return [RecomputeEntry.parse(p, "ORT") for p in self.plan.split(",") if p]


def find_opportunities(agent: Any, probe_config: str) -> list[Opportunity]:
    """The recompute opportunities of a training graph, from ORT's analysis of the session's memory plan.

    ``agent`` is a ``TrainingAgent`` of a session built *without* a memory optimizer config, so that every
    opportunity is still there.
    """
    _, found = agent.get_serialized_ortmodule_memory_stat("", probe_config, False)
    return [Opportunity(plan, int(freq), saving) for plan, (saving, freq) in found.items()]


def choose_entries(
    options: MemoryRecomputeOptions, opportunities: Sequence[Opportunity]
) -> tuple[list[RecomputeEntry], list[RecomputeEntry]]:
    """The entries to apply, and the user's entries that name clusters ORT did not find in this graph."""
    chosen: dict[str, RecomputeEntry] = {}
    allowed = {1: (1,), 2: (1, 2)}.get(options.level, ())
    for opportunity in opportunities:
        for entry in opportunity.entries:
            if entry.strategy in allowed:
                chosen.setdefault(entry.cluster, entry)
    found = {e.cluster for o in opportunities for e in o.entries}
    unknown = [e for e in options.config if e.cluster not in found]
    for entry in options.config:
        if entry.cluster in found:
            chosen[entry.cluster] = entry  # the user's entry wins over the level's choice
    # Inactive entries are never passed on: ORT 1.19.2 still recomputes some occurrences of a count of 0.
    return [e for e in chosen.values() if e.active], unknown


def plan_is_on(opportunity: Opportunity, applied: Sequence[RecomputeEntry]) -> bool:
    on = {(e.cluster, e.strategy) for e in applied}
    return all((e.cluster, e.strategy) in on for e in opportunity.entries)


def simplify_saving(expression: str) -> str:
    """ORT's saving expression in bytes, compact: ``2x(4*?*?) + 512*input_ids_dim0*input_ids_dim1``.

    ORT names the dimensions it can trace to an input (``input_ids_dim0``); the others get a fresh
    ``empty_dim_paramN`` each, shown as ``?``. Identical terms (one per occurrence of the cluster) are counted once.
    """
    try:
        import sympy
        from sympy.parsing.sympy_parser import parse_expr

        terms = sympy.Add.make_args(sympy.nsimplify(sympy.expand(parse_expr(expression))))
        texts = [re.sub(r"empty_dim_param\d+", "?", str(t)) for t in terms]
    except Exception:  # an expression sympy cannot read is still worth showing as ORT wrote it
        return re.sub(r"\s*\*\s*1\.000000", "", expression)
    counts: dict[str, int] = {}
    for text in texts:
        counts[text] = counts.get(text, 0) + 1
    return " + ".join(text if n == 1 else f"{n}x({text})" for text, n in counts.items())


def opportunity_table(
    options: MemoryRecomputeOptions, opportunities: Sequence[Opportunity], applied: Sequence[RecomputeEntry]
) -> str:
    """The table logged at INFO: every plan ORT found, ON or OFF, its frequency and its saving."""
    from ortcore.api import format_table

    on = sum(plan_is_on(o, applied) for o in opportunities)
    head = f"memory recompute: level {options.level} ({LEVELS[options.level]}), {on} of {len(opportunities)} plans ON"
    if not opportunities:
        return head + "; ORT found nothing to recompute in this graph"
    rows = [
        (i, "ON" if plan_is_on(o, applied) else "OFF", o.plan, o.frequency, simplify_saving(o.saving))
        for i, o in enumerate(sorted(opportunities, key=lambda o: o.plan), 1)
    ]
    notes = (
        []
        if options.enabled
        else [
            "  enable with ORTMODULE_MEMORY_OPT_LEVEL=1 (or 2), or list plans in ORTMODULE_MEMORY_OPT_CONFIG, e.g. "
            f"'{rows[0][2].split(',')[0]}'"
        ]
    )
    table = format_table(("plan", "status", "config", "freq", "saving in bytes (symbolic dims)"), rows)
    return "\n".join([head + ":", table, *notes])


# -- hooks -----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return MemoryRecomputeOptions


@hookimpl
def ortcore_session_plan(config: Any, graph: Any, plan: Any) -> None:
    # Nothing is kept for a backward that does not exist; the gradient audit compares gradients, not memory.
    if graph.kind != "training" or graph.purpose != "train":
        return
    options = _options(config)
    if not options.enabled:
        return  # the table alone (log level INFO) is read from the session itself: ortcore_session_created
    start = time.perf_counter()
    opportunities = _analyse(plan.probe(f"{NAME}: find the recompute opportunities of the training graph"), options)
    if opportunities is None:
        return
    applied: list[RecomputeEntry] = []
    if options.enabled:
        applied, unknown = choose_entries(options, opportunities)
        found = sorted({e.cluster for o in opportunities for e in o.entries})
        for entry in unknown:
            close = difflib.get_close_matches(entry.cluster, found, n=1)
            logger.warning(
                "memory_recompute: config entry '%s' names cluster %r, which ORT did not find in this graph%s; found: %s",
                entry,
                entry.cluster,
                f" (did you mean {close[0]!r}?)" if close else "",
                ", ".join(found) or "none",
            )
        if applied:
            # ORT reads the plan from a JSON file; if it cannot apply it, the core creates the session without it.
            path = plan.temporary_file(json.dumps([str(e) for e in applied]), suffix=".json")
            plan.add_optional(
                NAME,
                {CONFIG_ENTRY: path, PROBE_ENTRY: options.probe_config},
                # Recompute nodes must run right before their backward consumers, not wherever the default order
                # puts them.
                execution_order=onnxruntime.ExecutionOrder.MEMORY_EFFICIENT,
            )
    _show(config, options, opportunities, applied, start)


@hookimpl
def ortcore_session_created(config: Any, session: Any) -> None:
    """With recompute off, the opportunities are still logged at INFO: read from the session's own agent."""
    options = _options(config)
    if options.enabled or not session.request.build_gradient or config.core.log_level > LogLevel.INFO:
        return
    start = time.perf_counter()
    opportunities = _analyse(session, options)
    if opportunities is not None:
        _show(config, options, opportunities, [], start)


def _analyse(session: Any, options: MemoryRecomputeOptions) -> list | None:
    try:
        return find_opportunities(session.agent, options.probe_config)
    except Exception as e:  # an analysis ORT cannot do must not stop training
        logger.warning("memory_recompute: ORT could not analyse the training graph (%s: %s)", type(e).__name__, e)
        return None


def _show(config: Any, options: MemoryRecomputeOptions, opportunities: list, applied: list, start: float) -> None:
    if config.core.log_level <= LogLevel.INFO:
        logger.info(
            "%s\n  (analysis: %.2f s)", opportunity_table(options, opportunities, applied), time.perf_counter() - start
        )
