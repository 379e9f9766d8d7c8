"""The MoE policy: router, experts, expert-parallel token dispatcher, policy model, HF checkpoint I/O."""
