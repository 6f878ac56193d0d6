"""Hugging Face types that ``torch.utils._pytree`` does not know out of the box (the KV caches).

A ``GPT2LMHeadModel`` in training mode returns a ``DynamicCache`` by default (``use_cache`` is on in its config).
transformers ships the pytree registration for its caches (for ``torch.export``); this adapter applies it the
first time such an object crosses ortcore, so that the cache's tensors become graph outputs like any other.
"""

from __future__ import annotations

import sys

from .schema import LEAF_ADAPTERS


def register_transformers_cache(value: object) -> bool:
    """Register the pytree node of a transformers cache; return False for anything else."""
    if "transformers" not in sys.modules or not type(value).__module__.startswith("transformers."):
        return False
    from transformers.cache_utils import Cache, DynamicCache

    if not isinstance(value, Cache):
        return False
    if isinstance(value, DynamicCache) and type(value) is DynamicCache:
        from transformers.integrations.executorch import register_dynamic_cache_export_support

        register_dynamic_cache_export_support()
        return True
    try:
        from transformers.exporters.exporter_dynamo import register_pytree_node
    except ImportError:
        return False
    register_pytree_node(type(value))
    return True


LEAF_ADAPTERS.append(register_transformers_cache)
