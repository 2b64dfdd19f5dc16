"""The HF folder exported from a trained (resumed) policy is an ordinary model: transformers
gives the policy's logits, and the vLLM CPU engine serves it with the same prompt logprobs and
greedy continuation as transformers (one server start)."""

import secrets

import pytest
import torch
import transformers

from mlrl.rollout import EngineClient, EngineServer, ServerSpec
from mlrl.types import GenerationHyperparameters

LAYOUT = "tp2pp1ep1dp1"


@pytest.fixture(scope="module")
def exported(resumed_tp2, work):
    out = work / f"tp2_resumed_{LAYOUT}_hf"
    probe = torch.load(work / f"tp2_resumed_{LAYOUT}_probe.pt", weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    return out, probe, model


def test_export_layout(exported, tiny_model):
    out, _, _ = exported
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "config.json" in names and "generation_config.json" in names
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    assert (out / "config.json").read_text() == (tiny_model / "config.json").read_text()  # fp32 in, fp32 out
    assert not list(out.parent.glob(f".{out.name}.*"))  # no temporary left beside it


def test_transformers_logits_equal_the_policy(exported):
    _, probe, model = exported
    (mb,), (logits,) = probe["batch"], probe["logits"]
    cu = mb.cu_seqlens.tolist()
    worst = 0.0
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:]):
            ref = model(mb.tokens[a:b][None]).logits[0]
            worst = max(worst, float((logits[a:b] - ref).abs().max()))
    assert worst <= 1e-5, worst


async def test_vllm_serves_the_export(exported, work):
    out, _, model = exported
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "add 3 and 4"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    spec = ServerSpec(name="export", model_dir=str(out), dtype="float32", token=secrets.token_hex(16),
                      max_model_len=256, log_path=str(work / "vllm-export.log"), omp_threads=1)
    server = EngineServer(spec)
    server.start()
    client = None
    try:
        server.wait_ready(400)
        client = EngineClient(server.url, spec.token, timeout_s=300)
        got = await client.prompt_logprobs(prompt)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        ref = [float(lp[i, t]) for i, t in enumerate(prompt[1:])]
        assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-5
        seg = await client.generate(
            prompt, GenerationHyperparameters(max_new_tokens=8, greedy=True), request_id="greedy", default_version=0
        )
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                            eos_token_id=tok.eos_token_id)[0, len(prompt):].tolist()
        assert seg.tokens and seg.tokens == hf[: len(seg.tokens)]
    finally:
        if client is not None:
            await client.aclose()
        server.stop()
