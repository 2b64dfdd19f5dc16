"""Weight-sync throughput into live vLLM engines vs a raw torch.distributed broadcast of the same bytes.

    python tools/bench_weight_sync.py --model builtin:smollm2-135m-instruct [--engines 1] [--repeats 3] [--bucket-mb 64]
    python tools/bench_weight_sync.py --lora [--lora-rank 16]     # adapter sync vs full sync, same model

Starts the engines (mlrl.rollout.EnginePool), loads the model in HF transformers in this process
as the sender (tools/hf_weight_source.py), runs one warm-up sync (which also builds the
gloo group), then `--repeats` times, side by side over the SAME group:
  raw        the same tensor byte sizes broadcast with no protocol: no headers, no checksums,
             nothing applied (the wire's speed on this machine);
  protocol   the full wire protocol (headers, checksums on both ends, verification) received
             and dropped by the engines: the transfer without vLLM's load;
  transfer   a full weight sync: headers + CRC-32 on both ends + vLLM's load_weights and
             layer-wise finalize + LM-head refresh (`start` -> `finish` on the engines);
  sync       `WeightSync.sync(version)` end to end: pause, transfer, checksum comparison,
             prefix-cache reset, canary logprobs, resume.
Prints bytes/s of each and the ratios to raw (#16's goals: transfer/raw >= 0.9, end to end
(sync)/raw >= 0.5); the last lines are `ratio wire_vs_raw`, `ratio end_to_end_vs_raw` and
`ratio transfer_vs_raw`.
Median over repeats. With `--lora`: a full sync of the model (broadcast, plain engine) and then an
adapter sync (weight_sync.lora_mode=adapter: a PEFT folder of a rank-r all-linear adapter loaded by
an engine started with --enable-lora) of the same model, bytes and seconds of each; the last line
is the bytes ratio (goal < 0.05 at rank 16 on SmolLM2-135M).
raw and protocol are the benchmark's references (tools/weight_sync_reference.py, reached in the
engines through the hook that its worker extension, tools/weight_sync_reference_ext.py, adds to
mlrl's); transfer and sync are the production path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_weight_source, weight_sync_reference, tool_errors
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import weight_sync_reference
from hf_weight_source import HFWeightSource

from mlrl.config.schema import LoRAConfig, RolloutConfig, WeightSyncConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout import EnginePool
from mlrl.weight_sync import SyncSetup
from mlrl.weight_sync.transports import BroadcastWeightSync

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_model(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    try:
        import torch

        cpu = not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        cpu = True
    if cpu and hd not in VLLM_CPU_HEAD_SIZES:
        sys.exit(
            f"--model {model_dir}: head_dim {hd} is not supported by vLLM's CPU attention (supported: "
            f"{VLLM_CPU_HEAD_SIZES})"
        )


async def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)  # this process (sender + canary reference) shares the cores with the engines
    model_dir = resolve_model_dir(args.model)
    _check_model(model_dir)
    src = HFWeightSource.from_pretrained(model_dir)
    sizes = [t.numel() * t.element_size() for _, t in src.named_tensors()]
    total = sum(sizes)
    cfg = RolloutConfig(num_engines=args.engines, startup_timeout_s=600, max_model_len=args.max_model_len)
    # engines with the reference hook (weight_sync_reference_ext.ReferenceWorkerExtension)
    async with EnginePool(cfg, model_dir, run_dir=args.run_dir,
                          server_factory=weight_sync_reference.engine_server) as pool:
        ws = BroadcastWeightSync(WeightSyncConfig(bucket_mb=args.bucket_mb, canary_tolerance=args.canary_tolerance,
                                                  verify_checksums=not args.no_verify), pool, src,
                                 SyncSetup(model_dir=model_dir, engine_tp=cfg.engine_tp, host=cfg.host))
        first = await ws.sync(1)  # warm-up: builds the group
        raw_s, proto_s, transfer_s, sync_s, apply_s, canary = [], [], [], [], [], []
        for i in range(args.repeats):
            s, n = await weight_sync_reference.raw_broadcast(ws, sizes)
            assert n == total
            raw_s.append(s)
            proto_s.append(await weight_sync_reference.protocol_only(ws, 1000 + i))
            rep = await ws.sync(2 + i)
            transfer_s.append(rep.transfer_s)
            sync_s.append(rep.seconds)
            apply_s.append(rep.engine_apply_s)
            canary.append(rep.canary_max_abs_diff)
        await ws.close()
    med = statistics.median
    out = {
        "model": str(args.model),
        "engines": args.engines,
        "checksums": not args.no_verify,
        "bytes": total,
        "tensors": len(sizes),
        "bucket_mb": args.bucket_mb,
        "first_sync_s": first.seconds,
        "raw_s": med(raw_s),
        "protocol_s": med(proto_s),
        "transfer_s": med(transfer_s),
        "sync_s": med(sync_s),
        "engine_finalize_s": med(apply_s),
        "canary_max_abs_diff": max(canary),
    }
    out["raw_MBps"] = total / out["raw_s"] / 1e6
    out["protocol_MBps"] = total / out["protocol_s"] / 1e6
    out["transfer_MBps"] = total / out["transfer_s"] / 1e6
    out["sync_MBps"] = total / out["sync_s"] / 1e6
    out["ratio_protocol_vs_raw"] = out["raw_s"] / out["protocol_s"]
    out["ratio_transfer_vs_raw"] = out["raw_s"] / out["transfer_s"]
    out["ratio_sync_vs_raw"] = out["raw_s"] / out["sync_s"]
    return out


async def run_lora(args: argparse.Namespace) -> dict:
    """Full sync vs adapter sync of the same model, one after the other in this run."""
    import tempfile

    import torch
    from peft import get_peft_model

    from mlrl.ckpt_files.peft_adapter import peft_config
    from mlrl.weight_sync.lora_adapter import AdapterWeightSync

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    _check_model(model_dir)
    lora = LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    cfg = RolloutConfig(num_engines=args.engines, startup_timeout_s=600, max_model_len=args.max_model_len)
    setup = SyncSetup(model_dir=model_dir, engine_tp=cfg.engine_tp, host=cfg.host)
    med = statistics.median
    out: dict = {"model": str(args.model), "engines": args.engines, "lora_rank": args.lora_rank}

    full_src = HFWeightSource.from_pretrained(model_dir)
    async with EnginePool(cfg, model_dir, run_dir=args.run_dir) as pool:
        ws = BroadcastWeightSync(WeightSyncConfig(bucket_mb=args.bucket_mb, canary_tolerance=args.canary_tolerance),
                                 pool, full_src, setup)
        await ws.sync(1)  # warm-up: builds the group
        reps = [await ws.sync(2 + i) for i in range(args.repeats)]
        await ws.close()
    out.update(full_bytes=reps[0].bytes, full_transfer_s=med(r.transfer_s for r in reps),
               full_sync_s=med(r.seconds for r in reps), full_canary=max(r.canary_max_abs_diff for r in reps))
    del full_src

    model = get_peft_model(HFWeightSource.from_pretrained(model_dir).model, peft_config(lora, str(model_dir)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter (B = 0 would make the canary trivially the base's)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    src = HFWeightSource(model.eval())
    with tempfile.TemporaryDirectory(prefix="mlrl-bench-lora-") as tmp:
        async with EnginePool(cfg, model_dir, run_dir=args.run_dir, lora_rank=lora.rank) as pool:
            ws = AdapterWeightSync(WeightSyncConfig(transport="disk", lora_mode="adapter", disk_dir=tmp,
                                                    canary_tolerance=args.canary_tolerance),
                                   pool, src, setup, lora=lora)
            await ws.sync(1)
            reps = [await ws.sync(2 + i) for i in range(args.repeats)]
            await ws.close()
    out.update(adapter_bytes=reps[0].bytes, adapter_transfer_s=med(r.transfer_s for r in reps),
               adapter_sync_s=med(r.seconds for r in reps), adapter_canary=max(r.canary_max_abs_diff for r in reps))
    out["ratio_bytes"] = out["adapter_bytes"] / out["full_bytes"]
    out["ratio_sync_s"] = out["adapter_sync_s"] / out["full_sync_s"]
    return out


def main_lora(args: argparse.Namespace) -> int:
    r = asyncio.run(run_lora(args))
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"model {r['model']}: full sync (broadcast) vs LoRA rank {r['lora_rank']} all-linear adapter sync "
          f"(PEFT folder loaded by vLLM), median of {args.repeats}")
    print(f"  full sync     {r['full_bytes'] / 1e6:9.2f} MB  transfer {r['full_transfer_s']:.3f} s  sync "
          f"{r['full_sync_s']:.3f} s  canary max |diff| {r['full_canary']:.2e}")
    print(f"  adapter sync  {r['adapter_bytes'] / 1e6:9.2f} MB  transfer {r['adapter_transfer_s']:.3f} s  sync "
          f"{r['adapter_sync_s']:.3f} s  canary max |diff| {r['adapter_canary']:.2e}")
    print(f"ratio lora_sync_seconds_vs_full: {r['ratio_sync_s']:.3f}")
    print(f"ratio lora_sync_bytes_vs_full: {r['ratio_bytes']:.4f}")  # the goal metric, last (< 0.05)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct", help="HF folder or builtin:<name>")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engines' context (default: 512, or the model's max_position_embeddings if shorter)")
    p.add_argument("--canary-tolerance", type=float, default=1e-3)
    p.add_argument("--run-dir", default="runs/bench_weight_sync")
    p.add_argument("--no-verify", action="store_true", help="skip checksums (shows what they cost)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this (sender) process")
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    p.add_argument("--lora", action="store_true", help="adapter sync (weight_sync.lora_mode=adapter) vs full sync")
    p.add_argument("--lora-rank", type=int, default=16)
    args = p.parse_args(argv)
    if args.max_model_len is None:  # the tiny builtins allow 256 positions; vLLM refuses a longer context
        config = json.loads((resolve_model_dir(args.model) / "config.json").read_text())
        args.max_model_len = min(512, int(config.get("max_position_embeddings") or 512))
    if args.lora:
        return main_lora(args)
    r = asyncio.run(run(args))
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"model {r['model']}: {r['bytes'] / 1e6:.1f} MB in {r['tensors']} tensors -> {r['engines']} engine(s), "
          f"buckets {r['bucket_mb']:g} MiB, checksums {'on' if r['checksums'] else 'off'}, median of {args.repeats}")
    print(f"  raw broadcast   {r['raw_s']:7.3f} s  {r['raw_MBps']:8.1f} MB/s")
    print(
        f"  protocol only   {r['protocol_s']:7.3f} s  {r['protocol_MBps']:8.1f} MB/s   (headers + checksums, nothing "
        "loaded)"
    )
    print(
        f"  weight transfer {r['transfer_s']:7.3f} s  {r['transfer_MBps']:8.1f} MB/s   (of which vLLM finalize "
        f"{r['engine_finalize_s']:.3f} s)"
    )
    print(
        f"  full sync       {r['sync_s']:7.3f} s  {r['sync_MBps']:8.1f} MB/s   (pause, verify, canary, resume; first "
        f"sync {r['first_sync_s']:.2f} s)"
    )
    print(
        f"  ratio protocol/raw = {r['ratio_protocol_vs_raw']:.2f}   transfer/raw = {r['ratio_transfer_vs_raw']:.2f}  "
        f" sync/raw = {r['ratio_sync_vs_raw']:.2f}   (#16's goals: transfer/raw >= 0.9, end to end >= 0.5)"
        f"   canary max |diff| = {r['canary_max_abs_diff']:.2e}"
    )
    print(f"ratio wire_vs_raw: {r['ratio_protocol_vs_raw']:.3f}")  # the bytes moving, checksummed, not loaded
    print(f"ratio end_to_end_vs_raw: {r['ratio_sync_vs_raw']:.3f}")  # WeightSync.sync: pause .. resume
    print(f"ratio transfer_vs_raw: {r['ratio_transfer_vs_raw']:.3f}")  # moved AND loaded into vLLM: last
    return 0


if __name__ == "__main__":
    import tool_errors

    sys.exit(tool_errors.run("bench_weight_sync", main))
