"""`python -m recipes.study [--setup smollm2]`: the loss study (`recipes.experiments.study`)."""

import sys

from recipes.experiments.study import main

if __name__ == "__main__":
    sys.exit(main())
