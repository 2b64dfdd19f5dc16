"""tools/convert_checkpoint.py --bridge: resolved like model.bridge before any process starts
(megatron-bridge cannot be installed here, so asking for it names the package), a checkpoint
written through megatron-bridge is refused on a machine without it, and the generic architecture
record the megatron-bridge path keeps for mlrl's own bookkeeping reads common HF keys."""

import json
import shutil

import pytest
from helpers.tools import load_tool

from mlrl.bridge import BridgeError
from mlrl.modelzoo import hf_config_dict, resolve_model_dir


def _tool():
    return load_tool("convert_checkpoint")


def test_hf_to_mcore_with_megatron_bridge_names_the_missing_package(tmp_path, capsys):
    src = resolve_model_dir("builtin:tiny-llama")
    code = _tool().main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o"), "--bridge", "megatron-bridge"])
    err = capsys.readouterr().err
    assert code == 2 and "--bridge=megatron-bridge: megatron-bridge is not installed" in err, err
    assert not (tmp_path / "o").exists()


def test_hf_to_mcore_builtin_on_an_unknown_architecture_names_the_supported_ones(tmp_path, capsys):
    cfg = dict(hf_config_dict("builtin:tiny-llama"), model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = _tool().main(["hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--bridge", "builtin"])
    err = capsys.readouterr().err
    assert code == 2 and "gemma2" in err and "qwen3_moe" in err, err


def test_a_megatron_bridge_checkpoint_is_refused_without_it(tmp_path, capsys):
    from mlrl.ckpt_files.layout import FORMAT, MEGATRON_FILES
    from mlrl.trainer.rank.dist_ckpt import HF_FILES_DIR

    ck = tmp_path / "ck"
    (ck / HF_FILES_DIR).mkdir(parents=True)
    shutil.copy(resolve_model_dir("builtin:tiny-llama") / "config.json", ck / HF_FILES_DIR / "config.json")
    for f in MEGATRON_FILES:
        (ck / f).write_text("{}")
    meta = {"format": FORMAT, "bridge": "megatron-bridge", "hf_config": hf_config_dict("builtin:tiny-llama"),
            "layout": {"tp": 1, "pp": 1, "ep": 1}}
    (ck / "mlrl_checkpoint.json").write_text(json.dumps(meta))
    code = _tool().main(["mcore-to-hf", "--ckpt", str(ck), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "written through megatron-bridge" in err and "not installed" in err, err


def test_generic_arch_reads_common_hf_keys():
    from mlrl.trainer.rank.mbridge import generic_arch

    hf = dict(model_type="gemma2", vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4,
              max_position_embeddings=512, sliding_window=64, tie_word_embeddings=True)
    a = generic_arch(hf)
    assert (a.vocab_size, a.num_layers, a.num_kv_heads, a.head_dim, a.sliding_window) == (256, 3, 2, 16, 64)
    assert not a.is_moe and a.tie_embeddings
    moe = generic_arch({**hf, "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "use_sliding_window": False})
    assert moe.is_moe and moe.moe_topk == 2 and moe.sliding_window is None
    with pytest.raises(BridgeError, match="hidden_size, vocab_size and num_hidden_layers"):
        generic_arch({"model_type": "x"})  # no sizes at all: not a transformer config
