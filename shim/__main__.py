"""`python -m shim ...`; see shim/_cli.py."""

import sys

from ._cli import main

sys.exit(main())
