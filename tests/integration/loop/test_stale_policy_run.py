"""rollout.stale_policy end to end (`python -m mlrl.launch`, async, staleness eta = 1, TIS): with a
workflow whose groups for one answer return seconds after they were sampled
(workflows/slow_tail_workflow.py), some groups arrive more than eta versions behind. `drop`
discards them (counted in async/stale_dropped; nothing older than eta is trained on); `reweight`
trains on them (the staleness of trained samples exceeds eta, nothing is dropped), with the
importance-sampling correction weighing each token by the train/rollout probability ratio."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.launching import launch, metrics

WORKFLOW = "tests.integration.loop.workflows.slow_tail_workflow.SlowTailRLVR"
COMMON = ["--config", "launch/cpu_default.yaml", f"workflow.name={WORKFLOW}", "trainer.prompts_per_step=4",
          "trainer.samples_per_prompt=4", "trainer.total_steps=10", "rollout.staleness=1", "algorithm.rollout_is=tis",
          "logging.progress_bar=false", "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both policies launched at once (most of a launch is its engine and trainer ranks starting)."""
    root = tmp_path_factory.mktemp("stale")
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(launch, root / p, *COMMON, f"rollout.stale_policy={p}") for p in ("drop", "reweight")]
        for f in futs:
            f.result()
    return root


@pytest.mark.parametrize("policy", ["drop", "reweight"])
def test_stale_groups_are_dropped_or_trained_on(runs, policy):
    recs = metrics(runs / policy)
    assert [r["step"] for r in recs] == list(range(1, 11))
    dropped = sum(r["async/stale_dropped"] for r in recs)
    staleness = max(r["samples/staleness_max"] for r in recs)
    if policy == "drop":
        assert dropped > 0 and staleness <= 1, (dropped, staleness)
    else:
        assert dropped == 0 and staleness > 1, (dropped, staleness)
    assert all(r["train/updates"] >= 1 for r in recs)
