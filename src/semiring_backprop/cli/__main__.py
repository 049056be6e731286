"""``python -m semiring_backprop.cli``: the command line."""

import sys

from . import main

sys.exit(main())
