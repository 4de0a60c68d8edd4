"""``python -m train_recipes.cli``: the ``train-recipes`` command (torchrun's ``-m`` target)."""

import sys

from train_recipes.cli.main import main

sys.exit(main())
