"""``python -m nbaccel.cli``: the same as the ``nbaccel`` command."""

import sys

from nbaccel.cli.main import main

sys.exit(main())
