"""The type check of `make lint` has teeth: basedpyright, with the project's configuration, finds
a wrong argument to a trainer RPC (by name, type or return type) and an object that does not
satisfy a seam Protocol, and accepts the correct calls next to them."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SNIPPET = '''\
from mlrl.interfaces import Policy, Workflow
from mlrl.trainer.driver.client import TrainerClient
from mlrl.trainer.driver.group import TrainerGroup
from mlrl.trainer.rank.service import TrainerService
from mlrl.workflow.builtin.rlvr import RLVRWorkflow


def calls(g: TrainerGroup, mbs) -> None:
    g.call(TrainerService.finalize_checkpoints, blocking="yes")          # 9: wrong type
    g.call(TrainerService.export_hf, out_dir=3)                          # 10: wrong type
    g.call(TrainerService.save_checkpoint, paht="x")                     # 11: misspelt name
    g.call_sharded(TrainerService.compute_logprobs, mbs, temperature="hot")  # 12: wrong type
    ok: list[int] = g.call(TrainerService.finalize_checkpoints, blocking=True)
    bad: list[str] = g.call(TrainerService.finalize_checkpoints, blocking=True)  # 14: wrong result
    g.call_sharded(TrainerService.update, mbs)


class NotAPolicy:
    dp_size = 1


def protocols(t: TrainerClient, w: RLVRWorkflow) -> None:
    a: Policy = t
    b: Policy = NotAPolicy()                                             # 24: not a Policy
    c: Workflow = w
'''


def test_the_type_checker_catches_wrong_rpc_arguments_and_protocol_mismatches(tmp_path):
    src = tmp_path / "snippet.py"
    src.write_text(SNIPPET)
    exe = Path(sys.executable).with_name("basedpyright")
    proc = subprocess.run([str(exe), "-p", str(ROOT / "pyproject.toml"), "--outputjson", str(src)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    report = json.loads(proc.stdout)
    errors = {(d["range"]["start"]["line"] + 1, d.get("rule")) for d in report["generalDiagnostics"]
              if d["severity"] == "error"}
    lines = {line for line, _ in errors}
    assert lines == {9, 10, 11, 12, 14, 24}, sorted(errors)
    assert (11, "reportCallIssue") in errors and (9, "reportArgumentType") in errors
    assert proc.returncode == 1
