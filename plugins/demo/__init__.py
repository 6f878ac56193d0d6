"""The demo plugin: ``ortcore demo`` trains a small model in PyTorch and with ORTModule from the same weights and
data and compares the loss curves (:mod:`.run` trains, :mod:`.commands` prints). README's first command runs it.

Its command is registered in the ``ortcore.commands`` entry-point group (:mod:`.commands`, no torch at import);
disabling the plugin (``[plugins] disable = ["demo"]``) removes the command.
"""
