"""Where ``merge_activation_summary`` used to live: it belongs to the ``activation_stats`` plugin now
(:mod:`ortcore_plugins.activation_stats.merge_activation_summary`, command ``ortcore merge-activation-summary``).
Imports from here and ``python -m ortcore.hooks.merge_activation_summary --pt_dir ... --ort_dir ... --output_dir ...``
keep working."""

import sys

from ortcore_plugins.activation_stats.merge_activation_summary import *  # noqa: F403
from ortcore_plugins.activation_stats.merge_activation_summary import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
