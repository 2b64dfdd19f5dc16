"""After tools/gpu_kit/device_install.sh: the installed stack imports and vLLM generates.

Prints each package's version, then generates 10 tokens greedily with vLLM from a builtin model
(no download) and checks it got 10. Transformer Engine is checked only if its torch extension
is installed (`--need-te` makes its absence an error). Exit 0 when all passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for mlrl.modelzoo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--need-te", action="store_true", help="Transformer Engine must import too")
    a = ap.parse_args(argv)
    import torch

    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}"
    )
    ok = True
    for name in ("vllm", "megatron.core", "transformer_engine"):
        try:
            mod = importlib.import_module(name)
            print(f"{name} {getattr(mod, '__version__', '?')}")
        except Exception as e:
            print(f"{name}: import failed: {type(e).__name__}: {e}")
            ok = ok and not (name == "vllm" or name == "megatron.core")
    try:
        import transformer_engine.pytorch as te

        y = te.Linear(64, 64).cuda()(torch.randn(8, 64, device="cuda"))
        print(f"transformer_engine.pytorch: Linear ran, {tuple(y.shape)}")
    except Exception as e:
        print(f"transformer_engine.pytorch: {type(e).__name__}: {e}")
        ok = ok and not a.need_te
    if importlib.util.find_spec("flashinfer") is None:  # as mlrl.rollout.server does: the kit leaves it out
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams

    from mlrl.modelzoo import resolve_model_dir

    t0 = time.perf_counter()
    llm = LLM(model=str(resolve_model_dir(a.model)), enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=512)
    t1 = time.perf_counter()
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[
        0
    ].outputs[0]
    n = len(out.token_ids)
    print(f"vLLM: engine up in {t1 - t0:.1f} s; generated {n} tokens in {time.perf_counter() - t1:.2f} s: {out.text!r}")
    ok = ok and n == 10
    print("kit check: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
