"""ortcore's version (``ortcore.__version__``, ``ortcore.api.ORTCORE_VERSION``); pyproject.toml says the same."""

ORTCORE_VERSION = "0.1.0"
