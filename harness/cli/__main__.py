"""``python -m harness.cli``: the ``kvemu`` command."""

import sys

from harness.cli import main

sys.exit(main())
