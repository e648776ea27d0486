import sys

from attnscope.profile.cli import main

sys.exit(main())
