"""``python -m hsextract.model.warmup SPEC``: the warm-up process (process.py)."""

import sys

from hsextract.model.warmup.process import main

if __name__ == "__main__":
    sys.exit(main())
