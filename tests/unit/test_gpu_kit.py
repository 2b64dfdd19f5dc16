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
