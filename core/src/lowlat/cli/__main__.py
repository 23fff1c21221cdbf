"""``python -m lowlat.cli`` is the ``lowlat`` command."""

import sys

from lowlat.cli import main

sys.exit(main())
