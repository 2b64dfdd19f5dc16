"""The Megatron-Core trainer (the only package that imports megatron), in two halves named for
the process they run in:

- `mlrl.trainer.driver` (the driver process; imports no megatron): `group.TrainerGroup` starts
  the ranks (torchrun, or Ray node agents) and calls them; `client.TrainerClient` /
  `CriticClient` / `MegatronWeightSource` are the typed clients the loop and the weight sync hold.
- `mlrl.trainer.rank` (each Megatron rank, `python -m mlrl.trainer.rank.service`): the
  `TrainerService` the driver calls, `MegatronPolicy` / `MegatronCritic`, built on `cpu_compat`
  (CUDA-less machines), `model` (GPTModel build), `parallel`, `weights` (HF load / export),
  `inputs` (packed micro-batches), `logprobs`, `dist_ckpt` (megatron-core dist-checkpoint
  save / load / reshard behind small functions), `hf_export` (the streamed HF and PEFT exports),
  `conversion` (HF <-> Megatron checkpoints for tools/). What the ranks share with the driver's
  mlrl.checkpoint (folder names, HF / PEFT folder writers, CheckpointError, the init_from check)
  is mlrl.ckpt_files: no module here imports mlrl.checkpoint.
- `mlrl.trainer.rpc`: the wire between the two.
"""
