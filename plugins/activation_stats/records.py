"""The activation-statistics record format: the one definition the subscriber writes and the tools read.

Kept free of torch so that ``ortcore find-divergence`` and ``ortcore merge-activation-summary`` start fast.
"""

from __future__ import annotations

FORMAT = 1  # written into meta.json and every record; readers refuse any other
META_FILE = "meta.json"  # {"format", "source": "torch"|"ortcore", "rank", "world_size", "model"}
RECORDS_FILE = "records.jsonl"  # a step's records, one a line (the default layout)
STEP_DIR_PREFIX = "step_"  # one folder per step: step_<step>/
KINDS = ("forward", "backward")
# Every record holds these keys (and "samples": up to SAMPLES evenly spaced values of the flattened tensor).
RECORD_FIELDS = (
    "format", "name", "kind", "step", "order", "rank",
    "shape", "dtype", "numel", "min", "max", "mean", "std", "abs_mean", "zeros", "nans", "infs",
)  # fmt: skip
