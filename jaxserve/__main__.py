"""`python -m jaxserve COMMAND ...`: the `jaxserve` command (jaxserve.cli.main)."""

import sys

from jaxserve.cli.main import main

sys.exit(main())
