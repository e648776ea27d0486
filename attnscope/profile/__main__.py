"""`python -m attnscope.profile`: the driver's command line (cli.py)."""

import sys

from attnscope.profile.cli import main

sys.exit(main())
