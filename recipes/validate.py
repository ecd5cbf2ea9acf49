"""`python -m recipes.validate RECIPE.yaml [key=value ...]`: check a recipe before launch
(`recipes.planning.validate`)."""

import sys

from recipes.planning.validate import main

if __name__ == "__main__":
    sys.exit(main())
