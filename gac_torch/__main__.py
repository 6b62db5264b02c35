"""python -m gac_torch: the gac-torch command line (cli.py)."""

import sys

from gac_torch.cli import main

sys.exit(main())
