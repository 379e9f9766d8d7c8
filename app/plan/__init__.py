"""`moerl plan`: what one trainer GPU holds at the peak of a step, and what a policy version costs
to ship to the rollout fleet, computed from the model config and the layout before any GPU is
rented.

- `params`: every parameter tensor of the policy (names and shapes as transformers builds them),
  its FSDP2 shard per rank and the FSDP units the layout gathers.
- `activations`: bytes each decoder layer keeps for backward per micro-batch, term by term, as
  transformers' modules and moerl's MoE block save them.
- `deepep`: the arithmetic of DeepEP's ``ElasticBuffer.get_buffer_size_hint``.
- `nccl`: the NCCL buffers of the communicators the trainer uses (outside torch's allocator).
- `memory`: the per-GPU budget (terms, phases, peak, fits or not) and its constants.
- `search`: ``--search``, every layout of a world planned and ranked.
- `traffic`: bytes per published version and the weight-sync budget (issue 21).
- `cli`: the ``moerl plan`` command.

Everything here is arithmetic on a config: no torch tensor is allocated.
"""
