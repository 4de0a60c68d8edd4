"""`python -m train_testing.release ROOT`: fail when recipes' pins disagree with member versions.

uv does not check workspace members' versions against the specifiers that name them, so a stale
pin resolves silently inside the workspace and only breaks users who install from an index.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from train_testing.workspace import cross_imports, recipe_pin_problems

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    """Log the release problems of the workspace at ``argv[0]`` (default "."); 1 if any."""
    root = Path(argv[0] if argv else ".").resolve()
    problems = recipe_pin_problems(root) + cross_imports(root)
    for problem in problems:
        logger.error(problem)
    if not problems:
        logger.info("recipes' pins match the members' versions; no library imports another")
    return 1 if problems else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="release-check: %(message)s")
    sys.exit(main(sys.argv[1:]))
