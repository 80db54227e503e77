"""``python -m attnhub``: the same as the ``attnhub`` command."""

import sys

from .cli import main

sys.exit(main())
