"""``python -m benchmarks [--quick] [--only NAME...] [--json FILE] [--dir DIR] [--write-docs]``."""

import sys

from benchmarks._runner import main

if __name__ == "__main__":
    sys.exit(main())
