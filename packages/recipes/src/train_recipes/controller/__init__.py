"""Single-controller SFT on Ray (the ``train-recipes[ray]`` extra).

One driver process, one Ray actor per rank, placed by a placement group; torch.distributed runs
inside the actors.

Ray is imported only when a run asks for it (``--controller ray``); without the extra the
preflight names it before anything starts.
"""

from train_recipes.controller.driver import ControllerError, RayRun, run_sft_on_ray
from train_recipes.controller.ray_cluster import RAY_EXTRA, import_ray

__all__ = ["RAY_EXTRA", "ControllerError", "RayRun", "import_ray", "run_sft_on_ray"]
