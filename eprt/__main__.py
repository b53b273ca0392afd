"""`python -m eprt ...` is the `eprt` command."""

import sys

from eprt.cli import main

sys.exit(main())
