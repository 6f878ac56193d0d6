"""The doctor plugin: ``ortcore doctor`` checks the installation (versions, ONNX Runtime's training bindings, the
environment, plugins that failed to load, variables nothing reads) and trains one step of a tiny model against
PyTorch, suggesting a fix for each problem (:mod:`.checks` finds, :mod:`.commands` prints).

Its command is registered in the ``ortcore.commands`` entry-point group (:mod:`.commands`, no torch at import), so
it works when other plugins fail to import; disabling the plugin removes the command.
"""
