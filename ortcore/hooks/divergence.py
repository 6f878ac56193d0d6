"""Where ``find_divergence`` used to live: it belongs to the ``activation_stats`` plugin now
(:mod:`ortcore_plugins.activation_stats.divergence`, command ``ortcore find-divergence``). Imports from here and
``python -m ortcore.hooks.divergence PT_DIR ORT_DIR ...`` keep working."""

import sys

from ortcore_plugins.activation_stats.divergence import *  # noqa: F403
from ortcore_plugins.activation_stats.divergence import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
