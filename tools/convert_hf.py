"""`python tools/convert_hf.py SRC OUT [--dtype D]`: the same as `jaxserve convert`
(jaxserve.cli.convert), kept for source checkouts."""

import sys

from jaxserve.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
