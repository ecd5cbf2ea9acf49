"""`python -m recipes.lowdata`: Study B, the low-data regression (`recipes.experiments.lowdata`)."""

import sys

from recipes.experiments.lowdata import main

if __name__ == "__main__":
    sys.exit(main())
