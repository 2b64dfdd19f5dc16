"""data.mix, a prompt mixture for RL and evaluation runs: what validation refuses (by field), how
the sources are loaded and tagged, each epoch's composition (data.mix[i].weight), each source's
reward (data.mix[i].reward or its dataset's own) and the per-source metrics."""

import json
import pickle
from collections import Counter
from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate
from mlrl.config.schema import DataConfig, DataSource
from mlrl.data import DatasetError, dataset_from_config
from mlrl.data.registry import mix_rewards
from mlrl.data.sampler import PromptSampler
from mlrl.jobs.evaluate_run import first_prompts
from mlrl.metrics.pass_at_k import pass_metrics
from mlrl.registry import LookupFailed
from mlrl.reward.mixture import SourceReward
from mlrl.types import EpisodeStatus, Sample, SampleStatus
from mlrl.workflow.runner import EpisodeResult, GroupResult, summarize

ROOT = Path(__file__).resolve().parents[3]
TWO = "data.mix=[{name: digit, train: 'synthetic:copy_digit', eval: 'synthetic:copy_digit'}, " \
      "{name: pair, train: 'synthetic:copy_pair'}]"


def _rl(*overrides):
    return load_config(None, ["model.hf_dir=builtin:tiny-llama", "data.max_prompt_tokens=64", *overrides])


def _eval(*overrides):
    return load_config(ROOT / "launch" / "eval_cpu.yaml", ["model.hf_dir=builtin:tiny-llama", "data.eval=null",
                                                           *overrides])


def _mix(*sources, **data):
    return DataConfig(mix=[DataSource(**s) for s in sources], num_synthetic=data.pop("num_synthetic", 40), **data)


def test_an_rl_mix_validates_and_its_held_out_set_is_evaluated():
    validate(_rl(TWO, "data.eval_every=2"), has_cuda=False)
    with pytest.raises(ConfigError, match=r"^data.mix\[0\].eval=mix\(digit=synthetic:copy_digit\) is never evaluated"):
        validate(_rl(TWO), has_cuda=False)


@pytest.mark.parametrize("override,match", [
    ("data.train=synthetic:add_digits", r"^data.train=synthetic:add_digits: set together with data.mix"),
    ("data.eval=synthetic:add_digits", r"^data.eval=synthetic:add_digits: set together with data.mix"),
])
def test_data_train_and_eval_are_refused_beside_a_mix(override, match):
    with pytest.raises(ConfigError, match=match):
        validate(_rl(TWO, "data.eval_every=2", override), has_cuda=False)


@pytest.mark.parametrize("mix,match", [
    ("[{name: 'a b', train: x.jsonl}]", r"^data.mix\[0\].name='a b': expected a label"),
    ("[{train: x.jsonl}]", r"^data.mix\[0\].name='': expected a label"),
    ("[{name: a, train: x.jsonl}, {name: a, train: y.jsonl}]", r"^data.mix\[1\].name='a': two sources with one name"),
    ("[{name: a}]", r"^data.mix\[0\].train: not set"),
    ("[{name: a, train: x.jsonl, weight: 0}]", r"^data.mix\[0\].weight=0.0: expected a number > 0"),
    ("[{name: a, train: x.jsonl, weight: 2}, {name: b, train: y.jsonl}]",
     r"^data.mix\[1\].weight: not set while data.mix\[0\].weight is"),
    ("[{name: a, train: x.jsonl, reward: reward_model}]", r"^workflow.reward=reward_model with data.mix"),
])
def test_a_malformed_source_is_named(mix, match):
    with pytest.raises(ConfigError, match=match):
        validate(_rl(f"data.mix={mix}"), has_cuda=False)


def test_workflow_reward_is_refused_when_every_source_has_its_own():
    """copy_digit and copy_pair bring their rewards: workflow.reward would score nothing; a file
    source has none, and workflow.reward is its reward."""
    with pytest.raises(ConfigError, match=r"^workflow.reward=gsm8k: every data.mix source has a reward of its own "
                                          r"\(digit: exact_match, pair: token_match\)"):
        validate(_rl(TWO, "data.eval_every=2", "workflow.reward=gsm8k"), has_cuda=False)
    validate(_rl("data.mix=[{name: a, train: 'synthetic:copy_digit'}, {name: b, train: x.jsonl}]",
                 "workflow.reward=gsm8k"), has_cuda=False)


def test_offline_runs_read_data_train_not_a_mix():
    with pytest.raises(ConfigError, match=r"^data.mix: a prompt mixture for RL and evaluation runs; a sft run"):
        validate(load_config(ROOT / "launch" / "sft_cpu.yaml", ["data.train=synthetic:copy_digit", TWO]),
                 has_cuda=False)


def test_an_evaluation_mix_answers_each_sources_eval():
    ok = "data.mix=[{name: a, eval: 'synthetic:copy_digit'}, {name: b, eval: 'synthetic:copy_pair'}]"
    validate(_eval(ok), has_cuda=False)
    for mix, match in [("[{name: a, eval: 'synthetic:copy_digit', train: 'synthetic:copy_digit'}]",
                        r"^data.mix\[0\].train=synthetic:copy_digit: the training prompts"),
                       ("[{name: a, eval: 'synthetic:copy_digit', weight: 2}]", r"^data.mix\[0\].weight=2.0: a share"),
                       ("[{name: a, eval: 'synthetic:copy_digit'}, {name: b}]", r"^data.mix\[1\].eval: not set")]:
        with pytest.raises(ConfigError, match=match):
            validate(_eval(f"data.mix={mix}"), has_cuda=False)


def test_sources_are_loaded_tagged_and_spanned_in_mix_order():
    d = _mix({"name": "digit", "train": "synthetic:copy_digit", "eval": "synthetic:copy_digit"},
             {"name": "pair", "train": "synthetic:copy_pair"}, num_synthetic=30)
    ds = dataset_from_config(d, "train")
    assert [(s.name, s.start, s.size) for s in ds.sources] == [("digit", 0, 30), ("pair", 30, 30)]
    assert [r["data_source"] for r in ds.rows] == ["digit"] * 30 + ["pair"] * 30
    assert ds.rows[0]["answer"] == ds.rows[0]["messages"][0]["content"].split()[-1]  # (copy_digit's own row)
    held = dataset_from_config(d, "eval")  # only the sources with an eval
    assert [s.name for s in held.sources] == ["digit"] and {r["data_source"] for r in held.rows} == {"digit"}
    assert ds.name == "mix(digit=synthetic:copy_digit, pair=synthetic:copy_pair)"


def test_a_bad_source_is_named_by_its_field(tmp_path):
    d = _mix({"name": "ok", "train": "synthetic:copy_digit"}, {"name": "gone", "train": str(tmp_path / "no.jsonl")})
    with pytest.raises(DatasetError, match=r"^data.mix\[1\].train \(source 'gone'\): dataset .*no such file"):
        dataset_from_config(d, "train")


def _epoch_sources(d, seed=0, shuffle=True):
    ds = dataset_from_config(d, "train")
    s = PromptSampler(ds, seed=seed, shuffle=shuffle)
    n = sum(s.quotas())
    return s, [r["data_source"] for r in s.next_batch(n)], ds


@pytest.mark.parametrize("weights,want", [((1.0, 1.0), {"a": 40, "b": 40}), ((3.0, 1.0), {"a": 60, "b": 20}),
                                          ((1.0, 3.0), {"a": 20, "b": 60}), ((None, None), {"a": 40, "b": 40})])
def test_weights_set_each_epochs_composition(weights, want):
    """data.mix[i].weight: a larger weight gives its source a larger share of each epoch."""
    d = _mix({"name": "a", "train": "synthetic:copy_digit", "weight": weights[0]},
             {"name": "b", "train": "synthetic:copy_pair", "weight": weights[1]})
    s, sources, _ = _epoch_sources(d)
    assert Counter(sources) == want
    assert Counter(r["data_source"] for r in s.next_batch(sum(want.values()))) == want  # the next epoch too


def test_an_upweighted_small_source_cycles_through_all_its_rows_before_repeating():
    d = _mix({"name": "big", "train": "synthetic:copy_pair", "weight": 1.0},
             {"name": "small", "train": "synthetic:copy_digit", "weight": 3.0}, num_synthetic=10)
    ds = dataset_from_config(d, "train")
    s = PromptSampler(ds, seed=3)
    assert s.quotas() == [5, 15]
    rows = s.next_batch(20) + s.next_batch(20)
    assert Counter(r["data_source"] for r in rows) == {"big": 10, "small": 30}
    # its stream: passes over its 10 rows, each a permutation (every row once per pass)
    stream = [i for i in PromptSampler(ds, seed=3)._mix_order(ds.sources, 0) if i >= 10] + \
             [i for i in PromptSampler(ds, seed=3)._mix_order(ds.sources, 1) if i >= 10]
    assert Counter(stream) == {i: 3 for i in range(10, 20)}
    big = [i for e in (0, 1) for i in PromptSampler(ds, seed=3)._mix_order(ds.sources, e) if i < 10]
    assert sorted(big) == list(range(10))  # the big source's 10 rows over two epochs of 5: each once


def test_the_order_is_seeded_and_resumes_exactly():
    d = _mix({"name": "a", "train": "synthetic:copy_digit", "weight": 2.0},
             {"name": "b", "train": "synthetic:copy_pair", "weight": 1.0})
    ds = dataset_from_config(d, "train")
    one = PromptSampler(ds, seed=5)
    first = one.next_batch(50)
    resumed = PromptSampler.from_state(ds, one.state(), seed=5)
    assert [id(r) for r in resumed.next_batch(70)] == [id(r) for r in one.next_batch(70)]
    assert [id(r) for r in PromptSampler(ds, seed=5).next_batch(50)] == [id(r) for r in first]
    assert [id(r) for r in PromptSampler(ds, seed=6).next_batch(50)] != [id(r) for r in first]


def test_without_shuffle_sources_keep_their_order_interleaved_evenly():
    d = _mix({"name": "a", "train": "synthetic:copy_digit", "weight": 3.0},
             {"name": "b", "train": "synthetic:copy_pair", "weight": 1.0}, num_synthetic=8)
    s, sources, ds = _epoch_sources(d, shuffle=False)
    assert "".join(sources) == "aabaaabaaabaaaba"  # a's 12 and b's 4 of 16, evenly
    rows = dataset_from_config(d, "train").rows
    first = PromptSampler(ds, seed=0, shuffle=False).next_batch(16)
    assert [r["answer"] for r in first if r["data_source"] == "b"] == [r["answer"] for r in rows[8:12]]


def test_each_source_gets_its_own_reward():
    """data.mix[i].reward, else the dataset's own (copy_digit: exact_match, copy_pair: token_match),
    else workflow.reward; the dispatcher scores each row by its source's."""
    d = _mix({"name": "digit", "train": "synthetic:copy_digit"}, {"name": "pair", "train": "synthetic:copy_pair"},
             {"name": "file", "train": "x.jsonl"}, {"name": "own", "train": "synthetic:copy_pair",
                                                    "reward": "exact_match"})
    names = mix_rewards(d, "gsm8k")
    assert names == {"digit": "exact_match", "pair": "token_match", "file": "gsm8k", "own": "exact_match"}
    fn = SourceReward({k: names[k] for k in ("pair", "own")})
    row = {"messages": [], "answer": "7 7"}
    # token_match gives partial credit for one of two tokens; exact_match none: the source decides
    assert fn("p", "7 3", [], [], data_source="pair", **row) == pytest.approx(0.5)
    assert fn("p", "7 3", [], [], data_source="own", **row) == 0.0
    with pytest.raises(ValueError, match=r"data_source='other' is not a source of data.mix \(pair, own\)"):
        fn("p", "7 3", [], [], data_source="other", **row)
    assert pickle.loads(pickle.dumps(fn))("p", "7 7", [], [], data_source="own", **row) == 1.0
    assert getattr(fn, "mlrl_inline", False)  # both inline: called in the driver
    assert not getattr(SourceReward({"a": "exact_match", "b": "gsm8k"}), "mlrl_inline", False)
    with pytest.raises(LookupFailed, match=r"the reward of data.mix source 'b' \(nope\): unknown reward 'nope'"):
        SourceReward({"a": "exact_match", "b": "nope"})


def test_a_mix_of_inline_rewards_refuses_the_reward_pool_settings_and_a_pooled_one_keeps_them():
    inline = "data.mix=[{name: a, train: 'synthetic:copy_digit'}, {name: b, train: 'synthetic:copy_pair'}]"
    with pytest.raises(ConfigError, match=r"^workflow.reward_timeout_s.*inline reward"):
        validate(_rl(inline, "workflow.reward_timeout_s=5"), has_cuda=False)
    pooled = "data.mix=[{name: a, train: 'synthetic:copy_digit'}, {name: b, train: 'synthetic:arith_word'}]"
    validate(_rl(pooled, "workflow.reward_timeout_s=5"), has_cuda=False)


def _group(source, rewards):
    def sample(r):
        return Sample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0.0] * 3, versions=[0] * 3, reward=r,
                      prompt_len=1, status=SampleStatus.COMPLETED)

    eps = [EpisodeResult(status=EpisodeStatus.COMPLETED, samples=[sample(r)]) for r in rewards]
    return GroupResult("g", {"messages": [], "answer": "1", **({"data_source": source} if source else {})}, eps)


def test_rollout_and_pass_metrics_are_reported_per_source():
    groups = [_group("math", [1.0, 0.0]), _group("code", [0.0, 0.0]), _group("math", [1.0, 1.0])]
    m = summarize(groups)
    assert m["source/math/groups"] == 2 and m["source/code/groups"] == 1
    assert m["source/math/reward/mean"] == pytest.approx(0.75) and m["source/code/reward/mean"] == 0.0
    assert m["source/math/reward/accuracy"] == pytest.approx(0.75) and m["reward/mean"] == pytest.approx(0.5)
    p = pass_metrics(groups, 2, 1.0)
    assert p["eval/source/math/pass@1"] == pytest.approx(0.75) and p["eval/source/code/pass@2"] == 0.0
    assert p["eval/pass@1"] == pytest.approx(0.5)
    assert not [k for k in summarize([_group(None, [1.0])]) if k.startswith("source/")]  # no source: none


def test_max_prompts_takes_the_first_prompts_of_each_source():
    d = _mix({"name": "a", "eval": "synthetic:copy_digit"}, {"name": "b", "eval": "synthetic:copy_pair"})
    ds = dataset_from_config(d, "eval")
    got = first_prompts(ds, 3)
    assert [r["data_source"] for r in got] == ["a"] * 3 + ["b"] * 3
    assert got[3] is ds.rows[ds.sources[1].start] and len(first_prompts(ds, 0)) == len(ds)


def test_a_resume_with_another_mix_says_the_order_changes(caplog):
    def ds(w, n=40, first="synthetic:copy_digit"):
        return dataset_from_config(_mix({"name": "a", "train": first, "weight": w},
                                        {"name": "b", "train": "synthetic:copy_pair", "weight": 1.0}, num_synthetic=n),
                                   "train")

    three = ds(3.0)
    saved = PromptSampler(three, seed=0)
    saved.next_batch(5)
    state = json.loads(json.dumps(saved.state()))  # (as a checkpoint stores it)
    assert state["mix"] == [["a", 40, 60], ["b", 40, 20]]
    assert [id(r) for r in PromptSampler.from_state(three, state, seed=0).next_batch(9)] == \
        [id(r) for r in saved.next_batch(9)]
    assert "mixture" not in caplog.text
    PromptSampler.from_state(ds(1.0), state, seed=0)  # other weights
    assert "[['a', 40, 60], ['b', 40, 20]]" in caplog.text and "[['a', 40, 40], ['b', 40, 40]]" in caplog.text
    caplog.clear()
    old = {k: v for k, v in state.items() if k != "mix"}  # a checkpoint from before data.mix: no warning
    PromptSampler.from_state(ds(3.0), old, seed=0)
    assert "mixture" not in caplog.text


def test_metric_names_of_a_datasets_own_data_source_column_are_made_safe_and_bounded():
    m = summarize([_group("openai/gsm8k", [1.0]), _group("my set", [0.0])])
    assert m["source/openai_gsm8k/reward/mean"] == 1.0 and m["source/my_set/reward/mean"] == 0.0
    many = summarize([_group(f"id{i}", [1.0]) for i in range(40)])  # a per-row id, not a source
    assert not [k for k in many if k.startswith("source/")]


@pytest.mark.parametrize("mix,match", [
    ("[{name: a, train: 'synthetic:copy_digit', eval: ''}]", r"^data.mix\[0\].eval: empty"),
    ("[{name: a, train: 'synthetic:copy_digit', reward: ''}]", r"^data.mix\[0\].reward: empty"),
    ("[{name: a, train: 'synthetic:copy_digit', reward: nope}]", r"^data.mix\[0\].reward=nope: unknown reward"),
    ("[{name: '..', train: 'synthetic:copy_digit'}]", r"^data.mix\[0\].name='..': expected a label"),
    # a source's train and eval data made for two rewards: which one scores it is named, not guessed
    ("[{name: a, train: 'synthetic:copy_digit', eval: 'synthetic:copy_pair'}]",
     r"^data.mix\[0\].reward: not set, and the source's train data \(synthetic:copy_digit\) is made for the "
     r"exact_match reward while its eval data \(synthetic:copy_pair\) is made for token_match"),
])
def test_empty_unknown_or_ambiguous_source_settings_are_named(mix, match):
    with pytest.raises(ConfigError, match=match):
        validate(_rl(f"data.mix={mix}", "data.eval_every=1"), has_cuda=False)


def test_a_sources_eval_data_gives_its_reward_when_its_train_data_has_none():
    d = _mix({"name": "a", "train": "x.jsonl", "eval": "synthetic:copy_pair"})
    assert mix_rewards(d, "exact_match") == {"a": "token_match"}
    validate(_rl("data.mix=[{name: a, train: 'synthetic:copy_digit', eval: 'synthetic:copy_pair', "
                 "reward: token_match}]", "data.eval_every=1"), has_cuda=False)


def test_a_held_out_only_source_is_evaluated_never_trained_on():
    """A source with eval and no train (a benchmark watched during training, verl's validation-only
    datasets): in the held-out set and scored by its own reward, absent from every training epoch,
    outside the weights."""
    mix = ("data.mix=[{name: a, train: 'synthetic:copy_digit', eval: 'synthetic:copy_digit', weight: 2}, "
           "{name: b, train: 'synthetic:copy_pair', "
           "weight: 1}, {name: bench, eval: 'synthetic:reverse_digits'}]")
    cfg = _rl(mix, "data.eval_every=2", "data.num_synthetic=30")
    validate(cfg, has_cuda=False)
    s, sources, ds = _epoch_sources(cfg.data)
    assert [x.name for x in ds.sources] == ["a", "b"] and Counter(sources) == {"a": 40, "b": 20}
    held = dataset_from_config(cfg.data, "eval")
    assert [x.name for x in held.sources] == ["a", "bench"] and len(held.rows) == held.sources[1].start + 30
    assert mix_rewards(cfg.data, "gsm8k")["bench"] == "token_match"  # reverse_digits' own
    for bad, match in [
        ("[{name: a, train: 'synthetic:copy_digit'}, {name: bench, eval: 'synthetic:reverse_digits', weight: 1}]",
         r"^data.mix\[1\].weight=1.0: a share of the training prompts, and source 'bench' has none"),
        ("[{name: a, eval: 'synthetic:copy_digit'}, {name: bench, eval: 'synthetic:reverse_digits'}]",
         r"^data.mix: every source is held-out only"),
        ("[{name: a, train: 'synthetic:copy_digit'}, {name: b}]", r"^data.mix\[1\].train: not set; .* or both"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(_rl(f"data.mix={bad}", "data.eval_every=2"), has_cuda=False)
    with pytest.raises(ConfigError, match=r"^data.mix\[1\].eval=.* is never evaluated with data.eval_every=0"):
        validate(_rl("data.mix=[{name: a, train: 'synthetic:copy_digit'}, "
                     "{name: bench, eval: 'synthetic:reverse_digits'}]"), has_cuda=False)
