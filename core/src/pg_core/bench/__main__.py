"""``python -m pg_core.bench``: the command line of :mod:`pg_core.bench`."""

import sys

from .cli import run

sys.exit(run())
