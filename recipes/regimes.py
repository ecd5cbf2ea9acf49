"""`python -m recipes.regimes --regime weight|length|data|task|control`: the regime study (`recipes.experiments.regimes`)."""

import sys

from recipes.experiments.regimes import main

if __name__ == "__main__":
    sys.exit(main())
