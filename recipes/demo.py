"""`python -m recipes.demo` (`make demo`): the CPU demo (`recipes.experiments.demo`)."""

import sys

from recipes.experiments.demo import main

if __name__ == "__main__":
    sys.exit(main())
