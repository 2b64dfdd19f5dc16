"""tools/convert_checkpoint.py: HF -> Megatron -> HF is bit-exact (SmolLM2-135M across a PP
change, tiny qwen3_moe at EP2), a LoRA training checkpoint becomes a PEFT adapter folder (and a
merged model) with the trained policy's logits, `--verify` reports the logits gap, and bad inputs
fail with one line naming the problem before any process starts."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.tools import load_tool
from safetensors.torch import load_file

from mlrl.modelzoo import resolve_model_dir

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "convert_checkpoint.py"


def _tool():
    return load_tool("convert_checkpoint")


def run_tool(*args: str, timeout: float = 600, tmpdir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout, env=env)


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_model(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    different = [n for n in ta if ta[n].dtype != tb[n].dtype or not ta[n].equal(tb[n])]
    assert different == [], different[:5]
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (b / f).is_file():
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f


def _gap(stdout: str) -> float:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("verify ok"))
    return float(line.split("difference| ")[1].split(" ")[0])


def test_smollm2_roundtrip_is_bit_exact(tmp_path):
    src = resolve_model_dir("builtin:smollm2-135m-instruct")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    t0 = time.perf_counter()
    r = run_tool("hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mcore"), "--pp", "2", "--verify",
                 tmpdir=scratch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(scratch.glob("mlrl-convert-*"))  # the ranks' job / report folder is removed
    assert not list(scratch.glob("torchelastic_*"))  # and torchrun made none (--log-dir=/dev/null)
    assert "hf-to-mcore:" in r.stderr  # the progress bar
    t1 = time.perf_counter()
    r2 = run_tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"), "--pp", "1",
                  "--max-shard-size", "200MB", "--no-progress")
    assert r2.returncode == 0, r2.stderr[-3000:]
    t2 = time.perf_counter()
    meta = json.loads((tmp_path / "mcore" / "mlrl_checkpoint.json").read_text())
    assert meta["layout"]["pp"] == 2 and meta["contents"]["optimizer"] is False
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) >= 3  # 538 MB in <= 200 MB shards
    assert_same_model(tmp_path / "hf", src)
    # fp32, 30 layers: the sharded Megatron model vs transformers; transformers' own floor (the
    # same rows as prefixes of longer sequences) is 6.5e-5 on logits of magnitude ~33
    gap = _gap(r.stdout)
    assert gap <= 1e-3
    print(f"SmolLM2 hf-to-mcore (pp2) {t1 - t0:.1f} s, mcore-to-hf (pp1) {t2 - t1:.1f} s, logit gap {gap:.3g}")


def test_qwen3_moe_ep2_roundtrip_is_bit_exact(tmp_path):
    src = resolve_model_dir("builtin:tiny-qwen3-moe")
    r = run_tool("hf-to-mcore", "--hf", "builtin:tiny-qwen3-moe", "--out", str(tmp_path / "mcore"), "--ep", "2",
                 "--verify", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "mcore" / "mlrl_checkpoint.json").read_text())["layout"]["ep"] == 2
    r2 = run_tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"), "--verify",
                  "--no-progress")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "world=2" in r2.stdout  # the checkpoint's own layout (EP2) by default
    assert_same_model(tmp_path / "hf", src)
    assert _gap(r.stdout) <= 1e-4 and _gap(r2.stdout) <= 1e-4


def test_training_checkpoint_to_hf_on_another_layout(saved_tp2, work, tmp_path):
    """A TP2 training checkpoint (optimizer state included) -> HF on one rank: the weights the
    training run itself exported at that step."""
    r = run_tool(
        "mcore-to-hf", "--ckpt", str(work / "tp2_fr"), "--out", str(tmp_path / "hf"), "--tp", "1", "--no-progress"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world=1" in r.stdout
    assert_same_model(tmp_path / "hf", work / "tp2_step2_hf")


# ---- bad inputs: fail in the launching process, before any rank starts ---------------------------
@pytest.fixture(scope="module")
def tool():
    return _tool()


def _error(tool, capsys, *argv: str) -> str:
    rc = tool.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0 and "error:" in err, err  # one line
    return err


def test_checkpoint_argument_forms(tool, tmp_path):
    """--ckpt accepts model_optim/, step_N/ or a run's checkpoint root (its latest complete one)."""
    from mlrl.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path / "ckpts")
    for step in (3, 5):
        t = manager.begin(step)
        (t / "model_optim").mkdir()
        (t / "model_optim" / "metadata.json").write_text("{}")
        manager.commit(t, step, {})
    step5 = tmp_path / "ckpts" / "step_000005" / "model_optim"
    assert tool.resolve_ckpt(str(tmp_path / "ckpts")) == step5
    assert tool.resolve_ckpt(str(step5.parent)) == step5
    assert tool.resolve_ckpt(str(tmp_path / "ckpts" / "step_000003" / "model_optim")).parent.name == "step_000003"


def test_bad_inputs(tool, capsys, tmp_path):
    smol = resolve_model_dir("builtin:smollm2-135m-instruct")
    tiny = resolve_model_dir("builtin:tiny-llama")
    out = str(tmp_path / "out")
    assert "does not exist" in _error(tool, capsys, "hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", out)
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _error(tool, capsys, "hf-to-mcore", "--hf", str(tmp_path / "empty"), "--out", out)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy2(tiny / "config.json", noweights / "config.json")
    assert "no *.safetensors" in _error(tool, capsys, "hf-to-mcore", "--hf", str(noweights), "--out", out)
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**conf, "model_type": "gpt_bigcode"}))
    assert "gpt_bigcode" in _error(tool, capsys, "hf-to-mcore", "--hf", str(other), "--out", out)
    (other / "config.json").write_text(json.dumps({**conf, "intermediate_size": 2 * conf["intermediate_size"]}))
    assert "shape" in _error(tool, capsys, "hf-to-mcore", "--hf", str(other), "--out", out)
    msg = _error(tool, capsys, "hf-to-mcore", "--hf", str(smol), "--out", out, "--tp", "2")
    assert "num_attention_heads=9" in msg
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "not empty" in _error(tool, capsys, "hf-to-mcore", "--hf", str(tiny), "--out", str(tmp_path / "full"))
    assert "does not exist" in _error(tool, capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "nope"), "--out", out)
    assert "not an mlrl checkpoint" in _error(
        tool, capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "empty"), "--out", out
    )
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "metadata.json").write_text("{}")
    (partial / "__0_0.distcp").write_text("")
    assert "incomplete" in _error(tool, capsys, "mcore-to-hf", "--ckpt", str(partial), "--out", out)
    assert "--max-shard-size" in _error(tool, capsys, "mcore-to-hf", "--ckpt", str(partial), "--out", out,
                                        "--max-shard-size", "lots")


# ---- LoRA checkpoints: a PEFT adapter folder, optionally the merged model ------------------------
LORA_WORKER = Path(__file__).with_name("lora_ckpt_worker.py")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_work(tmp_path_factory) -> Path:
    """A LoRA training checkpoint (2 Adam steps, B != 0), a full one, the trained policy's logits."""
    from trainer_harness import run_torchrun

    work = tmp_path_factory.mktemp("lora-ckpt")
    t0 = time.perf_counter()
    (r,), _ = run_torchrun(LORA_WORKER, ["--work", str(work)], 1, timeout=300)
    print(f"LoRA checkpoint (1 rank, 2 steps) {time.perf_counter() - t0:.1f} s")
    assert r["moved"] > 1e-3, r  # the adapters changed the model: a lost B would show
    return work


@pytest.fixture(scope="module")
def lora_converted(lora_work, tmp_path_factory) -> tuple[Path, Path, str]:
    """(adapter folder, merged folder, stdout) of the tool on the LoRA checkpoint, its own layout."""
    out = tmp_path_factory.mktemp("lora-out")
    t0 = time.perf_counter()
    r = run_tool("mcore-to-hf", "--ckpt", str(lora_work / "lora_ckpt"), "--out", str(out / "adapter"),
                 "--merged-out", str(out / "merged"), "--verify", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"LoRA mcore-to-hf (1 rank, PEFT + merged + verify) {time.perf_counter() - t0:.1f} s")
    return out / "adapter", out / "merged", r.stdout


def _gaps(stdout: str) -> dict[str, float]:
    """'verify ok (what): max |logit difference| X <= tol' lines -> {what: X}."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("verify ok")]
    return {ln.split("(")[1].split(")")[0]: float(ln.split("difference| ")[1].split(" ")[0]) for ln in lines}


def _probe_logits(model) -> torch.Tensor:
    """The HF model's logits [S, V] on the conversion's probe batch, one sample at a time."""
    from mlrl.trainer.rank.conversion import probe_micro_batch

    vocab = json.loads((resolve_model_dir("builtin:tiny-llama") / "config.json").read_text())["vocab_size"]
    mb = probe_micro_batch(vocab)
    cu = mb.cu_seqlens.tolist()
    with torch.no_grad():
        return torch.cat([model(mb.tokens[a:b][None]).logits[0].float() for a, b in zip(cu[:-1], cu[1:])])


def test_lora_checkpoint_to_peft_adapter_and_merged_model(lora_work, lora_converted):
    """The PEFT folder loads in peft on the base and gives the trained policy's logits; the merged
    folder loads in transformers alone and gives the same."""
    import transformers
    from peft import PeftModel

    adapter, merged, stdout = lora_converted
    assert sorted(f.name for f in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], sorted(conf["target_modules"])) == (8, 16.0, sorted(LORA_TARGETS))
    gaps = _gaps(stdout)
    assert sorted(gaps) == ["PEFT adapter on the base", "merged model"], stdout
    assert max(gaps.values()) <= 1e-5, gaps
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))

    want = torch.load(lora_work / "lora_logits.pt")  # the training policy, before its checkpoint was converted
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir("builtin:tiny-llama"),
                                                             dtype=torch.float32)
    peft_logits = _probe_logits(PeftModel.from_pretrained(base, str(adapter)).eval())
    merged_logits = _probe_logits(transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval())
    assert float((peft_logits - want).abs().max()) <= 1e-5
    assert float((merged_logits - peft_logits).abs().max()) <= 1e-5


def _moved_base(lora_work: Path, tmp_path: Path) -> Path:
    """A copy of the LoRA checkpoint whose recorded base folder does not exist (another machine)."""
    ckpt = tmp_path / "lora_ckpt_elsewhere"
    shutil.copytree(lora_work / "lora_ckpt", ckpt)
    meta = json.loads((ckpt / "mlrl_checkpoint.json").read_text())
    (ckpt / "mlrl_checkpoint.json").write_text(json.dumps({**meta, "base_hf_dir": str(tmp_path / "gone" / "tiny")}))
    return ckpt


def test_lora_checkpoint_on_tp2_with_base_override(lora_work, lora_converted, tmp_path):
    """A TP1 LoRA checkpoint converted on 2 ranks (Megatron reshards the adapters), its base given
    as --base builtin:<name>: the same adapter tensors."""
    ckpt = _moved_base(lora_work, tmp_path)
    t0 = time.perf_counter()
    r = run_tool("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "adapter"), "--tp", "2",
                 "--base", "builtin:tiny-llama", "--verify", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"LoRA mcore-to-hf (tp2, PEFT + verify) {time.perf_counter() - t0:.1f} s")
    assert "world=2" in r.stdout
    assert _gaps(r.stdout)["PEFT adapter on the base"] <= 1e-5
    got, want = _tensors(tmp_path / "adapter"), _tensors(lora_converted[0])
    assert sorted(got) == sorted(want) and all(got[n].equal(want[n]) for n in want)


def test_lora_bad_inputs(tool, capsys, lora_work, wide_model, tmp_path):
    full, lora = str(lora_work / "full_ckpt"), str(lora_work / "lora_ckpt")
    out, merged = str(tmp_path / "out"), str(tmp_path / "merged")
    tiny = "builtin:tiny-llama"
    msg = _error(tool, capsys, "mcore-to-hf", "--ckpt", full, "--out", out, "--merged-out", merged)
    assert "--merged-out applies to LoRA checkpoints only" in msg, msg
    msg = _error(tool, capsys, "mcore-to-hf", "--ckpt", full, "--out", out, "--base", tiny)
    assert "--base applies to LoRA checkpoints only" in msg, msg
    elsewhere = _moved_base(lora_work, tmp_path)
    msg = _error(tool, capsys, "mcore-to-hf", "--ckpt", str(elsewhere), "--out", out)
    assert "--base" in msg and str(tmp_path / "gone" / "tiny") in msg and "does not exist" in msg, msg
    msg = _error(tool, capsys, "mcore-to-hf", "--ckpt", lora, "--out", out, "--base", str(tmp_path / "nope"))
    assert msg.endswith(f"--base {tmp_path / 'nope'}: does not exist"), msg
    msg = _error(tool, capsys, "mcore-to-hf", "--ckpt", lora, "--out", out, "--base", str(wide_model))
    assert "--base" in msg and "not the architecture" in msg and "hidden_size" in msg, msg
    msg = _error(tool, capsys, "mcore-to-hf", "--ckpt", lora, "--out", out, "--merged-out", out)
    assert "--merged-out" in msg and "same folder as --out" in msg, msg
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "x").write_text("x")
    msg = _error(tool, capsys, "mcore-to-hf", "--ckpt", lora, "--out", out, "--merged-out", merged)
    assert msg.endswith(f"--merged-out {merged}: exists and is not empty (pass --force to replace it)"), msg
