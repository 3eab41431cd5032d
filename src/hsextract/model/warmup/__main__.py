import sys

from hsextract.model.warmup.process import main

sys.exit(main())
