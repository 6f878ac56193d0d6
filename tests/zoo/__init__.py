"""Model zoo: many architectures trained one step and three AdamW steps under ortcore, compared with PyTorch.

``catalog`` defines the models (tiny configs, random weights, dropout off), ``run_model`` runs one of them in its own
process and writes a JSON result, ``harness`` launches that process, ``test_zoo`` asserts every model's status
(slow-marked) and ``report`` writes ``docs/models.md``.
"""
