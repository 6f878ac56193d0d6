import sys

from .plot import main

sys.exit(main())
