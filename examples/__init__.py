"""Runnable examples: the CPU quickstart script and a custom pipeline stage."""
