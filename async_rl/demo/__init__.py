"""Demo tasks on a tiny local model: copy-digits (``task``) and lookup, an agent calling a tool
(``lookup``).

``python -m async_rl.demo prepare --output-dir DIR`` writes everything a verl run needs;
``DIR/overrides.txt`` lists the hydra overrides that point verl at the copy task,
``DIR/overrides_agent.txt`` at the lookup task, ``DIR/overrides_lora.txt`` at the copy task with a LoRA adapter.
"""

from async_rl.demo.reward import compute_score
from async_rl.demo.task import demo_overrides, prepare

__all__ = ["compute_score", "demo_overrides", "prepare"]
