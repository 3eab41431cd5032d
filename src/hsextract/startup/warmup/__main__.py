"""``python -m hsextract.startup.warmup SPEC``: the warm-up process (process.py)."""

import sys

from hsextract.startup.warmup.process import main

if __name__ == "__main__":
    sys.exit(main())
