"""The explain plugin: ``ortcore explain MODEL`` trains one step of a model through ORTModule and prints, per op kind,
where it runs (ORT's kernel or PyTorch's) and why (``ORTModule.explain()``).

Its command is registered in the ``ortcore.commands`` entry-point group (:mod:`.commands`, no torch at import);
disabling the plugin (``[plugins] disable = ["explain"]``) removes the command.
"""
