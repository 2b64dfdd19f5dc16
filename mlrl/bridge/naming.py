"""From the names a sharded Megatron model uses locally to the bridge's global names.

A rank's GPTModel numbers its decoder layers from 0 within its pipeline chunk and its experts
from 0 within its expert-parallel rank; the Transformer Engine layer spec also renames a few
tensors (the pre-attention / pre-MLP norms are fused into linear_qkv / linear_fc1 as
`layer_norm_weight`; grouped-GEMM experts are `experts.linear_fc1.weight<e>`). `global_name`
undoes all of that so that every rank speaks the names of `ArchSpec.params`.
"""

from __future__ import annotations

import re
from typing import Sequence

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQ_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

# Transformer Engine layer spec name -> local layer spec name (within a layer)
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def strip_wrappers(name: str) -> str:
    """Drop DDP / Float16Module wrapper prefixes ("module.")."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def global_name(local: str, layers: Sequence[int], expert_offset: int = 0) -> str:
    """Global name of a local parameter: `layers[i]` is the global index of local layer i."""
    name = strip_wrappers(local)
    m = _LAYER.match(name)
    if not m:
        return name
    i, rest = int(m.group(1)), m.group(2)
    rest = _TE_ALIASES.get(rest, rest)
    g = _GROUPED_EXPERT.match(rest)
    if g:
        rest = f"mlp.experts.local_experts.{int(g.group(2)) + expert_offset}.{g.group(1)}.weight"
    else:
        e = _SEQ_EXPERT.match(rest)
        if e:
            rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{layers[i]}.{rest}"
