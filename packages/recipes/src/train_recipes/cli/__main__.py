"""``python -m train_recipes.cli``: the ``train-recipes`` command (torchrun's ``-m`` target)."""

import sys

from train_recipes.cli.main import main

# Guarded so that importing every module of the package (the isolated-install check walks them
# all) does not run the command.
if __name__ == "__main__":
    sys.exit(main())
