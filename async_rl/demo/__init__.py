"""Copy-digits demo task: a tiny local model, data and reward for verl.

``python -m async_rl.demo prepare --output-dir DIR`` writes everything a verl
run needs; ``DIR/overrides.txt`` lists the hydra overrides that point verl at it.
"""

from async_rl.demo.reward import compute_score
from async_rl.demo.task import demo_overrides, prepare

__all__ = ["compute_score", "demo_overrides", "prepare"]
