"""``python -m stepdump`` runs the command line."""

import sys

from stepdump.cli.main import main

sys.exit(main())
