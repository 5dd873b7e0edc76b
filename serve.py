"""`python serve.py [flags]`: the same as `jaxserve serve [flags]` (jaxserve.cli.serve), kept
for source checkouts (`python serve.py --config configs/llama70b.py`)."""

import sys

from jaxserve.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
