"""Transformer Engine's torch extension, built once on a lent GPU machine, reused by the next ones.

Building it takes about 2 minutes of a lent machine's 15 (gpu_session.sh's `te build`: 112-130 s
on an H200), and the result is a 5.6 MB file that depends only on what it was compiled against:
Transformer Engine's version (the kit's sdist), torch's exact build, Python's minor version and
the CUDA architectures (NVTE_CUDA_ARCHS), all of which the lent machines' image fixes, plus the
TE core wheel and cuDNN frontend it links against and the GPU's compute capability. So a session
that builds it returns it in $OUT with that identity, and the next session carries both into the
kit folder and installs it instead of building when every field matches this machine; the session
then imports transformer_engine.pytorch and removes it again (the build follows) if that fails.

    python3 te_prebuilt.py save SITE KIT_DIR OUT   # after a build: OUT/te_torch.so + OUT/te_torch.json
    python3 te_prebuilt.py use KIT_DIR SITE        # before one: exit 0 once installed; 1, saying why, if
                                                   # there is none or it was built for something else
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

SO, META = "te_torch.so", "te_torch.json"
KEYS = ("te_torch_sdist", "te_core", "cudnn_frontend", "torch", "python", "cuda_archs", "gpu_capability")


def identity(kit_dir: Path) -> dict[str, str]:
    """What an extension built here would be built against, and the GPU it would run on."""
    import torch

    manifest = json.loads((kit_dir / "manifest.json").read_text())
    packages = manifest.get("packages", {})
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return {"te_torch_sdist": manifest["te_torch_sdist"],
            "te_core": packages.get("transformer-engine-cu13", packages.get("transformer-engine-cu12", "")),
            "cudnn_frontend": packages.get("nvidia-cudnn-frontend", ""), "torch": torch.__version__,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "cuda_archs": os.environ.get("NVTE_CUDA_ARCHS", "90"),  # device_install.sh's default
            "gpu_capability": f"{cap[0]}.{cap[1]}" if cap else "none"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _built(site: Path) -> list[Path]:
    return sorted((site / "transformer_engine" / "wheel_lib").glob("transformer_engine_torch*.so"))


def save(site: Path, kit_dir: Path, out: Path, ident: dict[str, str] | None = None) -> Path:
    (so,) = _built(site) or [None]
    if so is None:
        raise SystemExit(f"te_prebuilt: no transformer_engine_torch*.so under {site}/transformer_engine/wheel_lib")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(so, out / SO)
    meta = {**(ident or identity(kit_dir)), "file": so.name, "sha256": _sha256(so)}
    (out / META).write_text(json.dumps(meta, indent=1))
    return out / SO


def use(kit_dir: Path, site: Path, ident: dict[str, str] | None = None) -> str:
    """Install the carried extension into `site`; returns "" when done, else why not."""
    so, meta_file = kit_dir / SO, kit_dir / META
    if not (so.is_file() and meta_file.is_file()):
        return f"no {SO} and {META} in {kit_dir}"
    meta = json.loads(meta_file.read_text())
    here = ident or identity(kit_dir)
    differ = [f"{k}: built for {meta.get(k)!r}, this machine has {here[k]!r}" for k in KEYS if meta.get(k) != here[k]]
    if differ:
        return "; ".join(differ)
    if _sha256(so) != meta.get("sha256"):
        return f"{so}: sha256 differs from {META}'s (a truncated copy?)"
    dst = site / "transformer_engine" / "wheel_lib"
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / ".partial.so"  # whole or not at all: gpu_session.sh takes a present .so for a finished build
    shutil.copyfile(so, tmp)
    os.replace(tmp, dst / meta["file"])
    return ""


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "save":
        print(f"te_prebuilt: saved {save(Path(argv[1]), Path(argv[2]), Path(argv[3]))} for the next session")
        return 0
    if len(argv) == 3 and argv[0] == "use":
        why = use(Path(argv[1]), Path(argv[2]))
        print(f"te_prebuilt: {'not used: ' + why if why else 'installed the carried extension (no build)'}")
        return 1 if why else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
