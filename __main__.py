"""`python -m tierlab` runs the command line."""

import sys

from tierlab.app.cli.main import main

sys.exit(main())
