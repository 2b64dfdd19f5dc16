"""Convert between a Hugging Face model folder and mlrl's Megatron distributed checkpoint.

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N] [--verify]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt DIR --out DIR [--tp N --pp N --ep N] [--verify]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt LORA_DIR --out ADAPTER_DIR [--base HF_DIR]
        [--merged-out DIR] [--tp N --pp N --ep N] [--verify]
    python tools/convert_checkpoint.py --list     # supported architectures and RoPE types

hf-to-mcore writes a weights-only Megatron checkpoint (torch_dist, the format of a training
checkpoint's model_optim/ folder; training runs themselves start from the HF folder);
mcore-to-hf takes such a folder, a run's `step_N/` checkpoint or a run's checkpoint root (its
latest complete checkpoint) and writes safetensors shards + config.json +
generation_config.json + tokenizer files. A reward-model run's checkpoint (mlrl.jobs.rm) becomes a
one-label `*ForSequenceClassification` folder (`--verify` then compares scores).

A LoRA checkpoint (model.lora) holds only the adapters; its frozen base is the HF folder the
checkpoint records (base_hf_dir), or --base. mcore-to-hf then writes a PEFT adapter folder
(adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained(base, DIR)
or vLLM --enable-lora) at --out, and with --merged-out also the merged model (W + alpha/r B A)
as a full HF folder.

Everything that can be checked without loading weights is checked first, in this process: the
folder exists and is complete, config.json names a supported architecture, the safetensors
headers match it, the layout divides the model, the output is free. Then the conversion runs
on tp*pp*dp ranks (dp as expert parallelism needs): in this process for one rank, otherwise
under torchrun launched here (gloo on CPU, NCCL on GPU). Already inside torchrun (WORLD_SIZE
set, e.g. a multi-node job), it runs as that job's rank. `--verify` compares the logits of the
sharded Megatron model with transformers on the HF side of the conversion (LoRA: peft's adapter
on the base, and transformers on the merged folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_SIZE_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


class ConversionError(SystemExit):
    """A bad input: printed as one line, exit code 2."""

    def __init__(self, msg: str):
        super().__init__(2)
        self.msg = msg


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(_SIZE_UNITS, key=len, reverse=True):
        if unit and t.endswith(unit):
            num = t[: -len(unit)]
            break
    else:
        unit, num = "", t
    try:
        size = int(float(num) * _SIZE_UNITS[unit])
    except (ValueError, OverflowError):  # not a number; inf / 1e400
        size = 0
    if size < 1:
        raise ConversionError(f"--max-shard-size {text!r}: expected a positive size like 2GB, 500MB or 1048576")
    return size


def read_hf_config(hf: Path, flag: str) -> dict[str, Any]:
    """config.json of an HF folder (resolve_hf_dir found one): a file that is not JSON names itself."""
    try:
        return json.loads((hf / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{flag} {hf}: config.json is not valid JSON ({e})") from None


def _dtypes() -> tuple[str, ...]:
    """The model.dtype values (float32, bfloat16, float16)."""
    from typing import get_args

    from mlrl.config.schema import Dtype

    return get_args(Dtype)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true",
                    help="print the supported architectures and RoPE types (built-in bridge, megatron-bridge) and exit")
    sub = ap.add_subparsers(dest="command")
    h = sub.add_parser("hf-to-mcore", help="HF folder -> Megatron distributed checkpoint (weights)")
    h.add_argument(
        "--hf", required=True, help="Hugging Face model folder (config.json + safetensors) or builtin:<name>"
    )
    h.add_argument("--dtype", choices=["auto", *_dtypes()], default="auto",
                   help="dtype of the stored weights, as model.dtype (auto = config.json's dtype, float32 if it has "
                        "none or another)")
    h.add_argument("--precision", help=argparse.SUPPRESS)  # removed: a clear error pointing at --dtype
    h.add_argument("--bridge", choices=["auto", "builtin", "megatron-bridge"], default="auto",
                   help="HF <-> Megatron converter, as model.bridge (auto = built-in when it supports the model, "
                        "else megatron-bridge when installed); mcore-to-hf uses the one the checkpoint records")
    m = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF folder")
    m.add_argument("--ckpt", required=True, help="checkpoint folder (model_optim/, step_N/ or a run's checkpoint root)")
    m.add_argument("--dtype", choices=["auto", *_dtypes(), "keep"], default="auto",
                   help="dtype of the written tensors (auto = config.json's dtype, keep = the checkpoint's)")
    m.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    m.add_argument("--base", help="LoRA checkpoint: the HF folder (or builtin:<name>) of the frozen base "
                                  "(default: the one the checkpoint records)")
    m.add_argument("--merged-out", help="LoRA checkpoint: also write the merged model (W + alpha/r B A) as an HF "
                                        "folder here (--out receives the PEFT adapter)")
    for p in (h, m):
        p.add_argument("--out", required=True, help="output folder (must be empty or absent, unless --force)")
        p.add_argument(
            "--tp", type=int, default=None, help="tensor-parallel ranks (mcore-to-hf default: the checkpoint's)"
        )
        p.add_argument(
            "--pp", type=int, default=None, help="pipeline-parallel ranks (mcore-to-hf default: the checkpoint's)"
        )
        p.add_argument(
            "--ep", type=int, default=None, help="expert-parallel ranks (mcore-to-hf default: the checkpoint's)"
        )
        p.add_argument("--verify", action="store_true", help="compare logits with transformers after converting")
        p.add_argument("--verify-tol", type=float, default=1e-3, help="largest accepted |logit difference| (fp32)")
        p.add_argument("--force", action="store_true", help="replace a non-empty --out")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    w = sub.add_parser("_rank", help=argparse.SUPPRESS)  # one rank of a launched job
    w.add_argument("--job", required=True)
    return ap


# ---- checks before any process starts ------------------------------------------------------------
def resolve_ckpt(path: str) -> Path:
    """model_optim/ folder of a checkpoint given as that folder, step_N/ or a checkpoint root."""
    from mlrl.checkpoint import CheckpointManager
    from mlrl.ckpt_files.layout import META_FILE

    p = Path(path)
    if not p.exists():
        raise ConversionError(f"--ckpt {p}: does not exist")
    if (p / META_FILE).is_file() or (p / "metadata.json").is_file():
        return p
    if (p / "model_optim").is_dir():
        return p / "model_optim"
    found = CheckpointManager(p).latest()
    if found is not None:
        return found / "model_optim"
    raise ConversionError(f"--ckpt {p}: not an mlrl checkpoint (no {META_FILE}, no model_optim/, no complete step_N/)")


def resolve_hf_dir(text: str, flag: str) -> Path:
    """A Hugging Face model folder given as a path or builtin:<name>, with its config.json."""
    from mlrl.modelzoo import BUILTIN_PREFIX, resolve_model_dir

    if not text.startswith(BUILTIN_PREFIX) and not Path(text).exists():
        raise ConversionError(f"{flag} {text}: does not exist")
    if not text.startswith(BUILTIN_PREFIX) and not (Path(text) / "config.json").is_file():
        raise ConversionError(f"{flag} {text}: no config.json (expected a Hugging Face model folder)")
    try:
        hf = Path(resolve_model_dir(text))
    except Exception as e:  # a bad builtin name or folder
        raise ConversionError(f"{flag} {text}: {e}") from None
    if not (hf / "config.json").is_file():
        raise ConversionError(f"{flag} {hf}: no config.json (expected a Hugging Face model folder)")
    return hf


def lora_base(meta: dict, ckpt: Path, base: Optional[str]) -> Path:
    """The HF folder of a LoRA checkpoint's frozen base (--base, else the recorded base_hf_dir),
    checked to hold weights of the checkpoint's architecture."""
    from dataclasses import asdict

    from mlrl.bridge import BridgeError, HFCheckpoint, spec_for
    from mlrl.trainer.rank.dist_ckpt import lora_meta_base

    recorded = lora_meta_base(meta)
    if base is None:
        if not recorded:
            raise ConversionError(f"--ckpt {ckpt}: a LoRA checkpoint that records no base model (base_hf_dir): pass "
                                  "--base HF_DIR, the model it was trained on")
        if not Path(recorded).exists():
            raise ConversionError(f"--ckpt {ckpt}: the LoRA checkpoint's base model {recorded} (base_hf_dir) does not "
                                  "exist here: pass --base HF_DIR (or builtin:<name>), the model it was trained on")
    flag = "--base" if base is not None else f"--ckpt {ckpt}: base_hf_dir"
    hf = resolve_hf_dir(base if base is not None else recorded, flag)
    try:
        spec, arch = spec_for(read_hf_config(hf, flag))
        _, saved = spec_for(meta["hf_config"])
        HFCheckpoint(hf).check(spec, arch)
    except BridgeError as e:
        raise ConversionError(f"{flag} {hf}: {e}") from None
    a, b = asdict(saved), asdict(arch)
    diff = [f"{k}: checkpoint {a[k]!r}, base {b.get(k)!r}" for k in a if a[k] != b.get(k)]
    if diff:
        raise ConversionError(f"{flag} {hf}: not the architecture the LoRA checkpoint was trained on "
                              f"({'; '.join(diff)})")
    return hf


def check_layout(hf_config: dict, tp: int, pp: int, ep: int, what: str, bridge: str = "builtin") -> None:
    from mlrl.bridge import BridgeError, spec_for
    from mlrl.bridge import check_layout as bridge_check

    if min(tp, pp, ep) < 1:
        raise ConversionError(f"--tp/--pp/--ep must be >= 1, got {tp}/{pp}/{ep}")
    if bridge == "megatron-bridge":
        return  # megatron-bridge checks its own model against the layout when it builds it
    try:
        _, arch = spec_for(hf_config)
        bridge_check(arch, tp=tp, pp=pp, ep=ep, etp=tp, cp=1, vpp=None, pp_split=None)
    except (BridgeError, ValueError) as e:
        raise ConversionError(f"{what}: {e}") from None


def prepare(args) -> dict[str, Any]:
    """Validate the inputs; returns the job description the ranks run."""
    from mlrl.bridge import BridgeError, HFCheckpoint, spec_for
    from mlrl.bridge.arch import is_sequence_classifier
    from mlrl.bridge.select import resolve_bridge
    from mlrl.ckpt_files.errors import CheckpointError
    from mlrl.trainer.rank.conversion import check_output_dir

    job: dict[str, Any] = {"command": args.command, "out": str(Path(args.out).resolve()), "verify": args.verify,
                           "verify_tol": args.verify_tol, "progress": not args.no_progress}
    if args.command == "hf-to-mcore":
        if args.precision is not None:
            raise ConversionError("--precision was removed: use --dtype float32|bfloat16|float16 (fp32|bf16|fp16), "
                                  "named as model.dtype")
        hf = resolve_hf_dir(args.hf, "--hf")
        hf_config = read_hf_config(hf, "--hf")
        if is_sequence_classifier(hf_config):
            raise ConversionError(f"--hf {hf}: a {hf_config['architectures'][0]} (a reward model); hf-to-mcore "
                                  "converts causal LMs (a reward model's Megatron form is its training checkpoint)")
        try:
            bridge = resolve_bridge(args.bridge, hf_config, field="--bridge")
            if bridge == "builtin":
                spec, arch = spec_for(hf_config)
                HFCheckpoint(hf).check(spec, arch)
        except BridgeError as e:
            raise ConversionError(f"--hf {hf}: {e}") from None
        tp, pp, ep = (1 if v is None else v for v in (args.tp, args.pp, args.ep))  # 0 is refused, not 1
        dtype = args.dtype
        if dtype == "auto":
            dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
            dtype = dtype if dtype in _dtypes() else "float32"
        job.update(hf=str(hf), dtype=dtype, bridge=bridge)
    else:
        from mlrl.trainer.rank.dist_ckpt import HF_FILES_DIR, read_meta

        max_shard_bytes = parse_size(args.max_shard_size)
        path = resolve_ckpt(args.ckpt)
        try:
            meta = read_meta(path)
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
        if meta.get("role", "policy") == "critic":
            raise ConversionError(f"--ckpt {path}: a PPO critic's checkpoint (a value head on the policy's body) has "
                                  "no Hugging Face form; convert the policy's checkpoint (step_N/, not step_N/critic/)")
        if not (path / HF_FILES_DIR / "config.json").is_file():
            raise ConversionError(f"--ckpt {path}: {HF_FILES_DIR}/config.json is missing")
        hf_config = meta["hf_config"]
        job["reward_model"] = meta.get("role") == "reward_model"
        bridge = meta.get("bridge", "builtin")  # written before bridges were recorded: the built-in one
        if bridge == "megatron-bridge":
            try:
                resolve_bridge(bridge, hf_config, field=f"--ckpt {path} (written through megatron-bridge)")
            except BridgeError as e:
                raise ConversionError(str(e)) from None
        saved = meta["layout"]
        tp, pp, ep = (saved[k] if v is None else v for k, v in (("tp", args.tp), ("pp", args.pp), ("ep", args.ep)))
        job.update(ckpt=str(path), bridge=bridge, dtype=None if args.dtype == "keep" else args.dtype,
                   max_shard_bytes=max_shard_bytes, base=None, merged_out=None)
        if meta.get("lora"):
            job.update(base=str(lora_base(meta, path, args.base)),
                       merged_out=str(Path(args.merged_out).resolve()) if args.merged_out else None)
            if job["merged_out"] == job["out"]:
                raise ConversionError(f"--merged-out {args.merged_out}: the same folder as --out (the PEFT adapter)")
        else:
            for flag, value in (("--merged-out", args.merged_out), ("--base", args.base)):
                if value is not None:
                    raise ConversionError(f"{flag} applies to LoRA checkpoints only: {path} holds the full weights "
                                          "(--out receives the full HF model)")
    check_layout(hf_config, tp, pp, ep, "--tp/--pp/--ep", bridge=job["bridge"])
    _check_outputs_spare_inputs(job)
    try:
        check_output_dir(args.out, force=args.force)
        if job.get("merged_out"):
            check_output_dir(job["merged_out"], force=args.force, flag="--merged-out")
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    from mlrl.trainer.rank.conversion import world_size_for

    job.update(tp=tp, pp=pp, ep=ep, world=world_size_for(tp, pp, ep))
    return job


def _check_outputs_spare_inputs(job: dict[str, Any]) -> None:
    """An output folder is replaced whole (with --force when it exists): one that is an input, or
    holds one, would delete it."""
    inputs = {flag: Path(job[key]).resolve() for flag, key in (("--hf", "hf"), ("--ckpt", "ckpt"), ("--base", "base"))
              if job.get(key)}
    for out_flag, key in (("--out", "out"), ("--merged-out", "merged_out")):
        if not job.get(key):
            continue
        out = Path(job[key]).resolve()
        for in_flag, src in inputs.items():
            if out == src or out in src.parents:
                raise ConversionError(f"{out_flag} {out}: {'is' if out == src else 'holds'} the input {in_flag} {src}; "
                                      "writing there would replace it: choose another folder")


# ---- running the ranks ---------------------------------------------------------------------------
def run_rank(job: dict[str, Any]) -> dict[str, Any]:
    """This process's part of the conversion (a torchrun rank, or the only rank)."""
    import torch.distributed as dist

    from mlrl.trainer.rank import conversion

    rank = int(os.environ.get("RANK", "0"))
    bar = None
    if rank == 0 and job["progress"]:
        from tqdm import tqdm

        phases = 2 + int(job["verify"]) + int(bool(job.get("merged_out")))
        bar = tqdm(total=phases, desc=job["command"], unit="phase", file=sys.stderr)

    started = [False]

    def progress(text: str) -> None:  # each call starts the next phase
        if bar is not None:
            if started[0]:
                bar.update(1)
            started[0] = True
            bar.set_description(f"{job['command']}: {text}")

    try:
        if job["command"] == "hf-to-mcore":
            report = conversion.hf_to_mcore(job["hf"], job["out"], tp=job["tp"], pp=job["pp"], ep=job["ep"],
                                            dtype=job["dtype"], verify=job["verify"], bridge=job["bridge"],
                                            progress=progress)
        else:
            report = conversion.mcore_to_hf(job["ckpt"], job["out"], tp=job["tp"], pp=job["pp"], ep=job["ep"],
                                            dtype=job["dtype"], max_shard_bytes=job["max_shard_bytes"],
                                            verify=job["verify"], base=job["base"], merged_out=job["merged_out"],
                                            bridge=job["bridge"], progress=progress)
    finally:
        if bar is not None:
            bar.update(bar.total - bar.n)
            bar.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return report


def launch(job: dict[str, Any]) -> dict[str, Any]:
    """Run the job's ranks; returns rank 0's report. The job and report files live in a scratch
    folder removed afterwards, whatever happened."""
    report_dir = Path(tempfile.mkdtemp(prefix="mlrl-convert-"))
    try:
        return _launch(job, report_dir)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


def _launch(job: dict[str, Any], report_dir: Path) -> dict[str, Any]:
    from mlrl.procs import free_port, kill_tree, torchrun_command

    job = {**job, "report": str(report_dir / "report.json")}
    job_file = report_dir / "job.json"
    job_file.write_text(json.dumps(job))
    if job["world"] == 1 or "WORLD_SIZE" in os.environ:
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
            )
        return _rank_main(job_file)
    import torch

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job["world"])))
    cmd = torchrun_command(job["world"], str(Path(__file__).resolve()), "_rank", "--job", str(job_file))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait()
    except BaseException:
        kill_tree(proc.pid)  # never leave ranks behind (Ctrl-C, timeouts); workers have own sessions
        proc.wait()
        raise
    if rc != 0:
        err = Path(job["report"] + ".error")
        raise ConversionError(err.read_text().strip() if err.is_file() else f"conversion ranks exited with code {rc}")
    return json.loads(Path(job["report"]).read_text())


def _rank_main(job_file: Path) -> dict[str, Any]:
    job = json.loads(Path(job_file).read_text())
    rank = int(os.environ.get("RANK", "0"))
    try:
        report = run_rank(job)
    except Exception as e:
        if rank == 0:
            Path(job["report"] + ".error").write_text(f"{type(e).__name__}: {e}")
        raise
    if rank == 0:
        Path(job["report"]).write_text(json.dumps(report))
    return report


def list_supported() -> str:
    """The text of --list: what the built-in bridge converts, and megatron-bridge's status."""
    from mlrl.bridge import get_spec
    from mlrl.bridge.select import builtin_support, megatron_bridge_version

    sup = builtin_support()
    lines = ["built-in bridge (model.bridge=builtin; CPU and GPU):"]
    for mt in sup["model_types"]:
        lines.append(f"  {mt:<12} {get_spec(mt).hf_architectures[mt]}")
    lines.append(f"  rope types: {', '.join(sup['rope_types'])}")
    version = megatron_bridge_version()
    if version is None:
        lines.append("megatron-bridge (model.bridge=megatron-bridge; GPU environment, `bridge` extra): not installed")
    else:
        from mlrl.trainer.rank.mbridge import supported_architectures

        archs = supported_architectures()
        lines.append(f"megatron-bridge {version} (model.bridge=megatron-bridge; GPU): {len(archs)} architectures")
        lines.extend(f"  {a}" for a in archs)
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(list_supported())
        return 0
    if args.command is None:
        parser.error("a command is required (hf-to-mcore, mcore-to-hf) or --list")
    if args.command == "_rank":
        _rank_main(Path(args.job))
        return 0
    from mlrl.bridge import BridgeError
    from mlrl.ckpt_files.errors import CheckpointError

    try:
        job = prepare(args)
        report = launch(job)
    except ConversionError as e:
        print(f"convert_checkpoint.py {args.command}: error: {e.msg}", file=sys.stderr)
        return 2
    except (CheckpointError, BridgeError) as e:
        print(f"convert_checkpoint.py {args.command}: error: {e}", file=sys.stderr)
        return 2
    summary = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items())
    lora = job.get("base") is not None
    wrote = f"{job['out']} (PEFT adapter)" if lora else job["out"]
    if job.get("reward_model"):
        wrote += " (a one-label *ForSequenceClassification reward model)"
    if job.get("merged_out"):
        wrote += f" and {job['merged_out']} (merged model)"
    print(f"{args.command}: wrote {wrote} ({summary})")
    if not job["verify"]:
        return 0
    checks = [("max_abs_logit_diff", " (PEFT adapter on the base)" if lora else "", "logit")]
    if "merged_max_abs_logit_diff" in report:
        checks.append(("merged_max_abs_logit_diff", " (merged model)", "logit"))
    if job.get("reward_model"):  # a reward model has scores, not logits
        checks = [("max_abs_score_diff", "", "score")]
    failed = False
    for key, what, unit in checks:
        gap, tol = report[key], job["verify_tol"]
        if gap <= tol:
            print(f"verify ok{what}: max |{unit} difference| {gap:.3g} <= {tol:g}")
        else:
            print(f"verify FAILED{what}: max |{unit} difference| {gap:.3g} > --verify-tol {tol:g}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
