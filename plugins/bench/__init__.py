"""The bench plugin: ``ortcore bench`` trains Hugging Face BERT and GPT-2 under eager, ``torch.compile`` and
ortcore, each run in a fresh process, and reports first step, steady step, peak memory and loss as ratios to eager
(:mod:`.suite` runs and renders, :mod:`.commands` is the command line). ``--explain`` asks the op_profiler plugin,
by name, where a step's time goes.

Its command is registered in the ``ortcore.commands`` entry-point group (:mod:`.commands`, no torch at import);
disabling the plugin (``[plugins] disable = ["bench"]``) removes the command.
"""
