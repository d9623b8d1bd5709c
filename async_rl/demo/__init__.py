"""Demo tasks on a small local model: copy-digits (``task``), lookup, an agent calling a tool
(``lookup``), and long-tail, copy-digits with long-tailed response lengths fixed per prompt (``long_tail``).

``python -m async_rl.demo prepare --output-dir DIR [--model-size tiny|small|medium]`` writes everything a
verl run needs; ``DIR/overrides.txt`` lists the hydra overrides that point verl at the copy task,
``DIR/overrides_agent.txt`` at the lookup task, ``DIR/overrides_lora.txt`` at the copy task with a LoRA adapter,
``DIR/overrides_long.txt`` at the long-tail task (with a size other than tiny: its responses need the room).
"""

from async_rl.demo.reward import compute_score
from async_rl.demo.task import demo_overrides, prepare

__all__ = ["compute_score", "demo_overrides", "prepare"]
