"""`python -m recipes.validate RECIPE.yaml [key=value ...]`: check a recipe before launch
(`recipes.validation.validate`)."""

import sys

from recipes.validation.validate import main

if __name__ == "__main__":
    sys.exit(main())
