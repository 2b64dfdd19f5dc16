"""The Megatron-Core trainer (the only package that imports megatron).

Rank side: `init_parallel` and `MegatronPolicy` (mlrl.trainer.policy), built on
`cpu_compat` (CUDA-less machines), `model` (GPTModel build), `weights` (HF load / export),
`inputs` (packed micro-batches), `logprobs`. Driver side: `group` / `remote` / `service`.
Attributes are imported lazily so that the driver can import this package without megatron.
"""

from typing import Any

__all__ = ["MegatronPolicy", "init_parallel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mlrl.trainer import policy

        return getattr(policy, name)
    raise AttributeError(name)
