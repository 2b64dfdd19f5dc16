"""RL algorithms as pure torch functions: advantage estimators (advantages.py), policy losses and
loss aggregation (losses.py), KL estimators (kl.py), train/rollout mismatch correction
(mismatch.py), DAPO dynamic sampling and overlong shaping (sampling.py).

Nothing here imports megatron or vllm; the only data type shared with the trainer is
mlrl.experience.batch.MicroBatch, whose docstring is the contract. Submodules are not imported
eagerly so that mlrl.experience.packing can import the aggregation weights without a cycle.
"""
