"""Model zoo: many architectures trained one step and three AdamW steps under ortcore, compared with PyTorch, on each
exporter ("route": torchscript, the default, and dynamo).

``catalog`` defines the models (tiny configs, random weights, dropout off), ``catalog_wide`` a second zoo of other
models chosen for variety of ops, ``catalogs`` names the two (``main``, ``wide``), ``run_model`` runs one model in its
own process and writes a JSON result, ``harness`` launches that process on a route, ``failures`` groups failures by
cause (with minimal repros), ``test_zoo`` asserts every model's status (slow-marked: all pass on the default route,
the documented status on another), ``report`` keeps one record per route in ``records/`` and writes
``docs/models.md`` from them, and ``test_report`` checks that page against the records.
"""
