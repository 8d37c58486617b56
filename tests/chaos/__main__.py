"""``python -m tests.chaos``: see :mod:`tests.chaos`."""
import sys

from .run import main

sys.exit(main())
