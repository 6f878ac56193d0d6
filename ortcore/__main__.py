"""``python -m ortcore`` runs the ``ortcore`` command."""

import sys

from .cli import main

sys.exit(main())
