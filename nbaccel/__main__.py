"""``python -m nbaccel``: the ``nbaccel`` command line (the console script's ``main``)."""

import sys

from nbaccel.cli.main import main

sys.exit(main())
