"""The engine over a hierarchical cache (issue 32): token-identical outputs with the tiers on,
cached tokens by source, the tiers' KV events, and the disk tier across two engines.

A multi-turn workload on a device pool too small to keep the conversations: between two turns
of a conversation the others push its prefix off the device, so with a host tier it comes
back by a load-back (real tensor copies) instead of a recompute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_llava_processor, tiny_model

from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.errors import InvalidArgumentError
from minirad.kv_events import BlockRemoved, BlockStored
from minirad.kv_events.block_events import RadixBlockEvents

ATOL = 1e-4
TURN = 6  # new tokens per turn


@pytest.fixture(scope="module")
def llava():
    return tiny_model("llava-llama"), tiny_llava_processor()


def conversations(num: int = 4, turns: int = 3, prefix: int = 30) -> list[list[int]]:
    """Prompts in arrival order: each conversation's turn t is its turn t-1 plus TURN tokens;
    conversations take turns (round robin), so each comes back after the others."""
    rng = np.random.default_rng(0)
    convs = [[4 + c] + rng.integers(4, 96, prefix + TURN * turns).tolist() for c in range(num)]
    return [convs[c][: 1 + prefix + TURN * (t + 1)] for t in range(turns) for c in range(num)]


def run(engine: LLMEngine, prompts: list[list[int]]):
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    outs = [
        engine.generate([GenerateRequest(p, sampling_params=params, return_logits=True)])[0]
        for p in prompts
    ]
    engine.check_invariants()
    return outs


def assert_same_outputs(outs, refs) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def reference(llava):
    """The same prompts on a pool that keeps everything: the outputs to match."""
    return run(LLMEngine(llava[0], None, num_kv_slots=4096), conversations())


def test_a_host_tier_loads_back_what_the_device_evicted_and_changes_no_output(llava, reference):
    model = llava[0]
    device_only = LLMEngine(model, None, num_kv_slots=96)
    tiered = LLMEngine(model, None, num_kv_slots=96, hicache_ratio=4)
    blocks = RadixBlockEvents(tiered.bus, block_size=4, medium="GPU")
    outs_d, outs_t = run(device_only, conversations()), run(tiered, conversations())
    assert_same_outputs(outs_d, reference)
    assert_same_outputs(outs_t, reference)
    d, t = device_only.stats, tiered.stats
    assert t.cached_tokens > d.cached_tokens  # the host saved what the device lost
    assert t.prefill_tokens < d.prefill_tokens
    by_source = t.cached_tokens_by_source
    assert by_source["host"] > 0 and by_source.get("storage", 0) == 0
    assert sum(by_source.values()) == t.cached_tokens
    assert d.cached_tokens_by_source == {"device": d.cached_tokens}
    for o in outs_t:
        assert sum(o.stats.cached_tokens_by_source.values()) == o.stats.cached_tokens
    # The KV events tell both tiers apart, as vLLM's offloading does.
    events = blocks.take_events()
    stored = {e.medium for e in events if isinstance(e, BlockStored)}
    removed = {e.medium for e in events if isinstance(e, BlockRemoved)}
    assert stored == {"GPU", "CPU"} and "GPU" in removed


def test_write_policies_all_keep_outputs(llava, reference):
    for policy in ("write_through_selective", "write_back"):
        engine = LLMEngine(
            llava[0], None, num_kv_slots=96, hicache_ratio=2, hicache_write_policy=policy
        )
        assert_same_outputs(run(engine, conversations()), reference)


def test_the_disk_tier_serves_a_second_engine(llava, reference, tmp_path):
    """sglang #27619's case, "after a reboot": a new engine on the same folder finds the
    first one's pages on disk; a corrupt page is a miss, never wrong KV."""
    model, prompts = llava[0], conversations()
    first = LLMEngine(model, None, num_kv_slots=96, hicache_ratio=2, hicache_storage_dir=tmp_path)
    assert_same_outputs(run(first, prompts), reference)
    first.close()
    assert list(tmp_path.rglob("*.safetensors"))
    second = LLMEngine(model, None, num_kv_slots=96, hicache_ratio=2, hicache_storage_dir=tmp_path)
    last = prompts[-4:]  # each conversation's last turn, to an empty tree
    assert_same_outputs(run(second, last), reference[-4:])
    by_source = second.stats.cached_tokens_by_source
    assert by_source["storage"] > 0 and by_source["device"] == 0
    # Every file damaged: the third engine computes everything, and still matches.
    for f in tmp_path.rglob("*.safetensors"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    third = LLMEngine(model, None, num_kv_slots=96, hicache_ratio=2, hicache_storage_dir=tmp_path)
    assert_same_outputs(run(third, last), reference[-4:])
    assert third.stats.cached_tokens_by_source.get("storage", 0) == 0
    assert third.tree_cache.storage.notices


@pytest.mark.parametrize(
    "settings",
    [
        dict(hicache_ratio="2"),
        dict(hicache_ratio=0),
        dict(hicache_ratio=True),
        dict(hicache_ratio=2, hicache_write_policy="write_sometimes"),
        dict(hicache_storage_dir="/tmp/x"),  # no host tier
        dict(hicache_ratio=2, hicache_storage_dir=3),
    ],
)
def test_bad_tier_settings_are_typed_errors(llava, settings):
    with pytest.raises(InvalidArgumentError):
        LLMEngine(llava[0], None, num_kv_slots=96, **settings)
