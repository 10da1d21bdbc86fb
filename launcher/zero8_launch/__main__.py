"""`python -m zero8_launch ...` is `zero8-launch ...`."""

import sys

from .cli import main

sys.exit(main())
