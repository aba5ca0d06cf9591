"""`python -m gobrrr ...` (and `torchrun ... -m gobrrr ...`): the `gobrrr` command."""

import sys

from gobrrr.cli import main

if __name__ == "__main__":  # importing the module (pkgutil.walk_packages, say) runs nothing
    sys.exit(main())
