"""The Megatron-Core trainer (the only package that imports megatron), in two halves named for
the process they run in:

- `mlrl.trainer.driver` (the driver process; imports no megatron): `group.TrainerGroup` starts
  the ranks (torchrun, or Ray node agents) and calls them; `client.TrainerClient` /
  `CriticClient` / `MegatronWeightSource` are the typed clients the loop and the weight sync hold.
- `mlrl.trainer.rank` (each Megatron rank, `python -m mlrl.trainer.rank.service`): the
  `TrainerService` the driver calls, `MegatronPolicy` / `MegatronCritic`, built on `cpu_compat`
  (CUDA-less machines), `model` (GPTModel build), `parallel`, `weights` (HF load / export),
  `inputs` (packed micro-batches), `logprobs`, `checkpointing` (megatron-core dist-checkpoint
  calls behind small functions), `conversion` (HF <-> Megatron checkpoints for tools/).
- `mlrl.trainer.rpc`: the wire between the two.
"""
