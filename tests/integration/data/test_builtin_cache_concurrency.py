"""Four processes reach an empty (or stale) builtin-model cache at the same moment, half of them
looking like torch.distributed ranks > 0 (which materialise through a child process, since
transformers' save_pretrained writes nothing there): every one gets the same complete folder, loads
it with transformers, and no temporary folder is left behind. Real processes, a real file lock."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
N = 4  # two contenders of each kind for the lock (8 took twice as long on 2 cores, for no more cases)

CHILD = r'''
import hashlib, json, os, sys, time
from pathlib import Path
go = Path(sys.argv[1])
if sys.argv[2] == "rank1":  # looks like torch.distributed rank 1, to transformers and to mlrl alike
    import torch.distributed as dist
    dist.is_initialized = lambda: True
    dist.get_rank = lambda group=None: 1
import transformers
from mlrl.modelzoo import resolve_model_dir
Path(sys.argv[3]).write_text("ready")  # imports done
while not go.exists():  # everyone starts together
    time.sleep(0.005)
folder = resolve_model_dir("builtin:tiny-qwen3")
cfg = json.loads((folder / "config.json").read_text())
model = transformers.AutoModelForCausalLM.from_pretrained(folder)
digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
print(json.dumps({"folder": str(folder), "digest": digest, "vocab": cfg["vocab_size"],
                  "params": sum(p.numel() for p in model.parameters())}))
'''


@pytest.mark.parametrize("start", ["empty", "stale"])
def test_concurrent_processes_materialise_one_builtin_at_once(tmp_path, start):
    cache = tmp_path / "cache"
    if start == "stale":  # what an older mlrl left: marked complete, no weights
        stale = cache / "models" / "tiny-qwen3"
        stale.mkdir(parents=True)
        (stale / ".complete").write_text("ok\n")
        (stale / "tokenizer.json").write_text("{}")
    go = tmp_path / "go"
    env = dict(os.environ, MLRL_CACHE=str(cache), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ready = [tmp_path / f"ready-{i}" for i in range(N)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(go), "rank1" if i % 2 else "rank0", str(ready[i])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(N)]
    deadline = time.monotonic() + 120
    try:
        while not all(r.exists() for r in ready):  # every process has imported torch and transformers
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.05)
    except BaseException:
        for p in procs:  # they would spin on the start file forever
            p.kill()
        raise
    go.write_text("go")  # all at once: they spin on this file
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    folder = cache / "models" / "tiny-qwen3"
    assert {r["folder"] for r in results} == {str(folder)}
    assert len({r["digest"] for r in results}) == 1  # one materialisation, seen whole by everyone
    assert results[0]["digest"] == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert all(r["params"] > 0 and r["vocab"] == results[0]["vocab"] for r in results)
    assert (folder / ".complete").exists()
    left = sorted(p.name for p in (cache / "models").iterdir())
    assert left == [".tiny-qwen3.lock", "tiny-qwen3"], left  # no temporary folder left behind
