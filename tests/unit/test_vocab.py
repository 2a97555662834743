"""The experiment vocabulary (kvedit.harness.vocab): the names bench, eval and demo share resolve
to the same objects, and the KV bound and tokens-per-step figures are the hand-computed ones."""
import pytest

from kvedit.edits import KeyNorm, SnapKV, StreamingLLM
from kvedit.harness import vocab


def test_a_policy_by_registry_key_alias_or_class_name_is_one_policy():
    assert vocab.policy_key("streaming") == vocab.policy_key("StreamingLLM") == "streaming_llm"
    assert vocab.policy_key("keynorm") == vocab.policy_key("key_norm") == "key_norm"
    assert vocab.policy("streaming") == StreamingLLM(sink=4)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        vocab.policy_key("nope")


def test_sink_goes_only_to_policies_that_have_one():
    assert vocab.policy("snapkv", ratio=0.5, sink=49).sink == 49
    assert vocab.policy("keynorm", ratio=0.25, sink=49) == KeyNorm(ratio=0.25)
    assert vocab.policy("snapkv").sink == SnapKV().sink  # None: the policy's own default


def test_greedy_and_fixed_length_differ_only_in_ignore_eos():
    assert vocab.greedy(8) == {"max_tokens": 8, "temperature": 0.0}
    assert vocab.fixed_length(8) == {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_the_bound_is_how_many_more_requests_fit_at_once():
    # 9 prompts of 1024 + 383 tokens, capacity 6912: 4.91 fit whole, 7.72 with half dropped.
    w = vocab.Workload(9, 1024, 383, ratio=0.5)
    assert w.bound(6912) == pytest.approx((6912 / (512 + 383)) / (6912 / 1407))
    assert w.bound(10**9) == 1.0  # everything fits either way: nothing to gain
    assert vocab.at_once(4, 100, 10) == 4


def test_the_wave_bound_counts_whole_blocks_and_whole_waves():
    # The demo's default: 6 requests of 9 blocks unedited, 5 dropped, 30 blocks: 3 fit at once
    # (2 waves) against all 6 (1 wave). kvedit eval's gain: 12 of 5 blocks in 12 -> 6 waves.
    assert vocab.blocks(1024 + 65, 128) == 9 and vocab.blocks(128, 128) == 1
    assert vocab.wave_bound(6, 30, 9, 5) == 2.0
    assert [vocab.wave_bound(12, 12, 5, k) for k in (4, 3, 2)] == [1.5, 2.0, 3.0]
    with pytest.raises(ValueError, match="cannot hold one request"):
        vocab.waves(2, 4, 5)


def test_tokens_per_step_from_counter_snapshots():
    before = {"steps": 10.0, "generated": 20.0, "preemptions": 1.0, "prompt_computed": 5.0}
    after = {"steps": 30.0, "generated": 100.0, "preemptions": 1.0, "prompt_computed": 5.0}
    s = vocab.engine_steps(before, after)
    assert (s["steps"], s["tokens_per_step"], s["preemptions"]) == (20.0, 4.0, 0.0)
    assert vocab.engine_steps(None, after)["tokens_per_step"] is None
    assert vocab.ratio(6.0, 3.0) == 2.0 and vocab.ratio(None, 3.0) is None
