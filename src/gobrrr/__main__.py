"""`python -m gobrrr ...` (and `torchrun ... -m gobrrr ...`): the `gobrrr` command."""

import sys

from gobrrr.cli.main import main

sys.exit(main())
