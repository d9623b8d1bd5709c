"""A verl function tool that never answers (a hung sandbox or search API), loaded through
`actor_rollout_ref.rollout.multi_turn.function_tool_path`."""

import asyncio

from verl.tools.function_tool import function_tool


@function_tool
async def lookup_forever(key: str) -> str:
    """Looks a key up and never answers.

    Args:
        key: what to look up.
    """
    await asyncio.sleep(3600)
    return key
