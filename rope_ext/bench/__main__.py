"""``python -m rope_ext.bench``: runs the ``rope-bench`` command line."""

import sys

from .cli import main

sys.exit(main())
