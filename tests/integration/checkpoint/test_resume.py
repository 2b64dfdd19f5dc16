"""Resume is exact, checkpoints reshard (TP2 -> TP1 x DP2, PP2 -> PP1 x DP2), a killed save
leaves the previous checkpoint loadable, and bad inputs fail before any weight is touched.
Launches are shared session fixtures (conftest.py)."""

import json

import pytest
from safetensors.torch import load_file

from mlrl.checkpoint import CheckpointManager


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_resume_in_new_processes_is_bit_identical(saved_tp2, resumed_tp2, work):
    saved, _ = saved_tp2
    resumed, _ = resumed_tp2
    for s, r in zip(saved, resumed):
        ts, rs = s["train_save:tp2"], r["resume:tp2"]
        assert ts["first"] == ts["straight"][:2]  # the run that saved followed the straight run
        assert rs["losses"] == ts["straight"][2:], (rs["losses"], ts["straight"])  # exact, not approximately
        assert rs["digest"] == ts["straight_digest"]  # every exported tensor, bit for bit (stage senders)
        assert rs["rng_after_load"] == ts["rng_after_save"]  # python, numpy, torch, Megatron's tracker
        assert rs["info"]["rng_restored"] and rs["info"]["optimizer_loaded"]
        assert rs["info"]["optimizer_steps"] == 2 and rs["optimizer_steps"] == 4
        assert rs["info"]["scheduler_overrides"] == {}
    straight, again = _tensors(work / "tp2_straight_hf"), _tensors(work / "tp2_resumed_tp2pp1ep1dp1_hf")
    assert sorted(straight) == sorted(again)
    assert all(straight[n].dtype == again[n].dtype and straight[n].equal(again[n]) for n in straight)
    assert len(set(saved[0]["train_save:tp2"]["straight"])) == 4  # the steps really trained


@pytest.mark.parametrize("tag", ["tp2", "pp2", "moe"])
def test_reshard_to_tp1_dp2(saved_tp2, saved_pp2, resumed_dp2, tag):
    saved = {"tp2": saved_tp2, "pp2": saved_pp2, "moe": saved_tp2}[tag][0]
    resumed, _ = resumed_dp2
    straight = saved[0][f"train_save:{tag}@tiny-qwen3-moe" if tag == "moe" else f"train_save:{tag}"]["straight"]
    for r in resumed:
        res = r["resume:moe@tiny-qwen3-moe" if tag == "moe" else f"resume:{tag}"]
        assert res["info"]["optimizer_loaded"] and not res["info"]["rng_restored"]  # other layout, other ranks
        assert res["info"]["saved_layout"]["pp" if tag == "pp2" else "tp"] == 2 and r["ranks"]["dp_size"] == 2
        # step 3 depends on the weights, step 4 also on the resharded Adam moments
        assert abs(res["losses"][0] - straight[2]) <= 1e-6, (res["losses"], straight)
        assert abs(res["losses"][1] - straight[3]) <= 1e-6, (res["losses"], straight)


def test_bad_inputs_fail_before_loading(resumed_dp2, tiny_model):
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    for r in resumed_dp2[0]:
        e = r["errors:tp2"]
        assert e["missing"].startswith("CheckpointError") and "does not exist" in e["missing"]
        assert "incomplete" in e["incomplete"] and "mlrl_checkpoint.json" in e["incomplete"]
        assert "model_type: checkpoint 'llama', model 'qwen3'" in e["architecture"]
        assert "qk_norm: checkpoint False, model True" in e["architecture"]
        assert (
            "CheckpointError" in e["hidden_size"]
            and f"hidden_size: checkpoint {hidden}, model {2 * hidden}" in e["hidden_size"]
        )
        msg = e["dp_reshardable_after_layout_change"]
        assert "'dp_reshardable'" in msg and "tp 2 -> 1" in msg and "resume with tp=2" in msg
        assert e["untouched"]


def test_killed_save_leaves_the_previous_checkpoint(killed, resumed_dp2, saved_tp2):
    assert killed["returncode"] != 0
    tmp = killed["tmp"]
    assert tmp.name.startswith(".tmp-step_000002") and any((tmp / "model_optim").glob("*.distcp"))  # shards on disk
    assert not (tmp / "model_optim" / "mlrl_checkpoint.json").exists() and not (tmp / "COMPLETE").exists()
    manager = CheckpointManager(killed["root"])
    assert [p.name for p in manager.complete_checkpoints()] == ["step_000001"]
    assert manager.resolve_resume("auto").name == "step_000001"
    for r in resumed_dp2[0]:
        k = r["kill_resume:kill"]
        assert k["resumed_from"] == "step_000001" and k["state"]["weight_version"] == 1
        assert k["info"]["optimizer_loaded"] and k["info"]["optimizer_steps"] == 1
        # the step after the resume is step 2 of the same training (same model, config and batches):
        # the straight TP2 run's step-2 loss, up to the cross-layout noise of the reshard tests
        straight = saved_tp2[0][0]["train_save:tp2"]["straight"]
        assert abs(k["loss"] - straight[1]) <= 1e-6, (k["loss"], straight)
        assert "incomplete" in k["load_killed"] and "use an earlier checkpoint" in k["load_killed"]


def test_checkpoint_metadata(saved_tp2, work):
    meta = json.loads((work / "tp2_fr" / "mlrl_checkpoint.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["contents"] == {
        "model": True,
        "optimizer": True,
        "scheduler": True,
        "rng": True,
    }
    assert meta["optimizer"]["sharding"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert meta["optimizer"]["steps"] == 2 and meta["arch"]["model_type"] == "llama"
    assert (work / "tp2_fr" / "hf_files" / "config.json").is_file() and (
        work / "tp2_fr" / "hf_files" / "tokenizer.json"
    ).is_file()


def test_timings(saved_tp2, saved_pp2, resumed_tp2, resumed_dp2):
    """Not a bound on speed: records the costs (visible with -s) and checks that the measurements
    nest: the workers' phase clocks inside the launch's wall time, save / load inside their phase."""
    for name, (ranks, seconds) in {"saved_tp2": saved_tp2, "saved_pp2": saved_pp2, "resumed_tp2": resumed_tp2,
                                   "resumed_dp2": resumed_dp2}.items():
        for r in ranks:
            phases = [v["phase_s"] for v in r.values() if isinstance(v, dict) and "phase_s" in v]
            assert len(phases) == len(r) - 1 and 0 < sum(phases) < seconds, (name, phases, seconds)
        print(f"{name}: launch {seconds:.1f} s, phases {sum(phases):.1f} s")
    save, load = saved_tp2[0][0]["train_save:tp2"], resumed_tp2[0][0]["resume:tp2"]
    assert 0 < save["save_s"] < save["phase_s"] and 0 < load["load_s"] < load["phase_s"]
    print(f"save (first, incl. setup) {save['save_s']:.2f} s; load {load['load_s']:.2f} s")
