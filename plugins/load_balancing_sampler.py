"""load_balancing_sampler: complexity-balanced distributed samplers under ``ortcore.utils.data`` (being written)."""

from __future__ import annotations

NAME = "load_balancing_sampler"

# Read from the source by ortcore.utils.data when this plugin is disabled, to name it in the error.
DATA_UTILITIES = ("LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler")
