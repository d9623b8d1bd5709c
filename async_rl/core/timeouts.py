"""The engine's bounds on waits (s). Each stops a hang, not a slow start: verl waits on these without a limit."""

# starting worker groups or replicas (a replica's restart too), loading a checkpoint, the first sync. A vLLM
# replica's start can take over 300 s on 2 cores under the test lanes' load; a large model's load takes minutes
SETUP_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 120.0  # any other call on a stage
