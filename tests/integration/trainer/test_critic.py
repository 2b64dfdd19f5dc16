"""The Megatron critic (value model) on two gloo ranks, one torchrun launch (critic_worker.py):

- reference layout (tp1, dp2) for tiny-llama (tied embeddings) and tiny-qwen3-moe (untied):
  initial values exactly 0, body equal to the policy's bit for bit (no lm_head), three Adam updates
  lower the value loss, checkpoint after one update resumes bit-exactly, policy / critic
  checkpoints refuse to load into each other;
- the same non-zero value head and one SGD update (grad clipping active) under TP2, TP2 with
  sequence parallelism, PP2 (tiny-llama) and EP2 (tiny-qwen3-moe): values before and after the
  update, loss and grad norm equal the reference's within fp32 reduction-order noise.
"""

from pathlib import Path

import pytest
from trainer_harness import run_torchrun

WORKER = Path(__file__).with_name("critic_worker.py")
LAYOUTS = {"tiny-llama": ["tp2", "tp2+sp", "pp2"], "tiny-qwen3-moe": ["ep2"]}


@pytest.fixture(scope="module")
def ranks():
    layouts = [f"{m}:{name}" for m, names in LAYOUTS.items() for name in names]
    results, _ = run_torchrun(WORKER, ["--models", ",".join(LAYOUTS), "--layouts", ",".join(layouts)], 2, timeout=400)
    return results


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_initial_values_are_zero_and_the_body_is_the_policys(ranks, model):
    senders = 0
    for r in ranks:
        ref = r[f"{model}/ref"]
        assert ref["initial_abs_max"] == 0.0 and ref["initial_dtype"] == "torch.float32" and ref["initial_shapes_ok"]
        body = ref["body"]
        assert body["mismatched"] == []
        if body["sender"]:
            senders += 1
            # every HF tensor but the LM head (tied models have none of their own)
            assert sorted(set(body["policy_names"]) - set(body["names"])) == (
                [] if model == "tiny-llama" else ["lm_head.weight"]
            )
            assert "model.norm.weight" in body["names"] and "model.embed_tokens.weight" in body["names"]
        else:
            assert body["names"] == []
        assert "use compute_values" in ref["logprobs_error"]
    assert senders == 1


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_three_updates_lower_the_value_loss(ranks, model):
    for r in ranks:
        t = r[f"{model}/ref"]["train"]
        losses = t["losses"] + [t["final_loss"]]
        # measured (both models): 0.0241 -> 0.0205 -> 0.0113 -> 0.0041
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
        assert t["final_loss"] < 0.3 * t["losses"][0], losses
        assert t["value_loss_1"] == t["losses"][0]          # the loss_fn's own metric, summed over DP
        assert t["n_tokens"] == t["loss_tokens"] == 20.0     # whole step, both DP ranks
        assert t["lrs"] == [5e-4] * 3


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_checkpoint_resume_is_exact(ranks, model):
    for r in ranks:
        res = r[f"{model}/ref"]["resume"]
        assert res["optimizer_loaded"] and res["optimizer_steps"] == 1
        assert res["loss_equal"] and res["grad_norm_equal"] and res["lr_equal"], res
        assert res["values_equal"] and res["values_diff"] == 0.0, res


def test_policy_and_critic_checkpoints_do_not_mix(ranks):
    for r in ranks:
        err = r["tiny-llama/ref"]["role_errors"]
        assert "checkpoint holds a critic" in err["critic_into_policy"] and "is a policy" in err["critic_into_policy"]
        assert "checkpoint holds a policy" in err["policy_into_critic"] and "is a critic" in err["policy_into_critic"]


@pytest.mark.parametrize("model,layout", [(m, n) for m, names in LAYOUTS.items() for n in names])
def test_values_and_update_do_not_depend_on_the_layout(ranks, model, layout):
    ref = ranks[0][f"{model}/ref"]["sgd"]
    assert ref["moved"] > 0.5 and 0.3 < ref["values_abs_max"] < 2  # the update is not trivially small
    assert ref["grad_norm"] > 1.0  # clipping (critic.grad_clip=1) is active: the grad norm itself is compared
    for r in ranks:
        got = r[f"{model}/{layout}"]
        assert got["values_err"] <= 1e-6, got
        # after one update (|V| < 1, values moved by ~1.7): the gradient reduction order differs
        # (measured <= 6.6e-7; without the TP all-reduce of the head's gradient under sequence
        # parallelism 6e-2, and the grad norm off by 3e-3 relative)
        assert got["after_err"] <= 1e-5, got
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6, abs=0)
        assert got["grad_norm"] == pytest.approx(got["ref_grad_norm"], rel=1e-6, abs=0)
    sizes = {"tp2": ("tp_size", 2), "tp2+sp": ("tp_size", 2), "pp2": ("pp_size", 2), "ep2": ("ep_size", 2)}[layout]
    assert all(r[f"{model}/{layout}"]["ranks"][sizes[0]] == sizes[1] for r in ranks)


def test_the_critics_own_optimizer_fields_are_live(ranks):
    """critic.grad_clip / weight_decay / lr / lr_schedule / min_lr / lr_warmup_steps, each against the
    same SGD updates without it: clipping to 1e-4 shrinks the update, weight decay and a halved LR
    change it, and the cosine schedule's LRs are Megatron's (warm-up 1, decay over the run's 10)."""
    import math

    for model in LAYOUTS:
        k = ranks[0][f"{model}/ref"]["knobs"]
        assert k["plain"] > 1e-3, k
        assert k["clipped"] < 0.1 * k["plain"], k
        assert abs(k["decayed"] - k["plain"]) > 1e-3 * k["plain"], k
        assert abs(k["half_lr"] - k["plain"]) > 0.1 * k["plain"], k  # (three unclipped steps: not linear in lr)
        assert len(set(k["plain_lrs"])) == 1, k  # constant schedule
        lr = k["plain_lrs"][0]
        want = [lr] + [lr / 10 + 0.9 * lr * 0.5 * (1 + math.cos(math.pi * (s - 1) / 9)) for s in (2, 3)]
        assert k["cosine_lrs"] == pytest.approx(want, rel=1e-6), k
