"""ortcore's built-in plugins, one module each, registered through the ``ortcore.plugins`` entry points."""
