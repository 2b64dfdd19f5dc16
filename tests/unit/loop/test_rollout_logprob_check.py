"""A workflow whose samples carry no engine logprobs (metadata["missing_logprobs"]) cannot feed a
loss that reads them (algorithm.rollout_is, use_rollout_logprobs): refused with the workflow and the
setting named, instead of weights and ratios computed against 0.0."""

from pathlib import Path

import pytest

from mlrl.config import load_config
from mlrl.types import Sample
from mlrl.update import check_rollout_logprobs

DEFAULT = Path(__file__).resolve().parents[3] / "launch" / "cpu_default.yaml"


def _sample(missing: bool) -> Sample:
    return Sample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.5, -0.7], versions=[-1, 0, 0],
                  metadata={"missing_logprobs": True} if missing else {})


@pytest.mark.parametrize("overrides,refused", [
    ([], False),                                           # the trainer's own logprobs only
    (["algorithm.rollout_is=tis"], True),
    (["algorithm.use_rollout_logprobs=true"], True),
])
def test_missing_engine_logprobs_are_refused_where_the_loss_reads_them(overrides, refused):
    cfg = load_config(DEFAULT, overrides)
    check_rollout_logprobs(cfg, [_sample(False)])  # logprobs present: always fine
    if not refused:
        check_rollout_logprobs(cfg, [_sample(True), _sample(False)])
        return
    with pytest.raises(ValueError, match=r"workflow rlvr returned 1 of 2 sample\(s\) without logprobs"):
        check_rollout_logprobs(cfg, [_sample(True), _sample(False)])
