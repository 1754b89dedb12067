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


# ------------------------------------------------------------------ hostile pages and settings
def forge(folder, change) -> int:
    """Rewrite every page file with ``change(tensor)`` applied to its K and V, keeping its
    metadata and a valid digest: a well-formed page of the wrong shape (what a hostile or
    buggy writer could leave). Returns the number of files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from minirad.kvcache.hicache_storage import _digest

    files = list(folder.rglob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as g:
            meta = g.metadata()
            tensors = {k: change(g.get_tensor(k)) for k in g.keys()}  # noqa: SIM118
        meta["digest"] = _digest(tensors)
        save_file(tensors, str(f), metadata=meta)
    return len(files)


@pytest.mark.parametrize(
    "change",
    [lambda t: t[:, :5].contiguous(), lambda t: torch.cat([t, t], 1)],
    ids=["short", "long"],
)
def test_a_page_of_the_wrong_length_is_a_miss_and_the_engine_serves_on(
    llava, reference, tmp_path, change
):
    """Found by the hostile pass: a short page killed the engine thread (a shape error in the
    copy), a long one shifted the pages after it (wrong answers)."""
    model, prompts = llava[0], conversations()
    kw = dict(num_kv_slots=96, hicache_ratio=2, hicache_storage_dir=tmp_path)
    first = LLMEngine(model, None, **kw)
    run(first, prompts)
    first.close()
    assert forge(tmp_path, change) > 0
    second = LLMEngine(model, None, **kw)
    assert_same_outputs(run(second, prompts[-4:]), reference[-4:])
    assert second.stats.cached_tokens_by_source.get("storage", 0) == 0


def test_another_checkpoint_of_the_same_model_finds_no_pages(llava, tmp_path):
    """A fine-tune has the same config: the fingerprint must hold the weights too."""
    model, prompts = llava[0], conversations()
    kw = dict(num_kv_slots=96, hicache_ratio=2, hicache_storage_dir=tmp_path)
    first = LLMEngine(model, None, **kw)
    run(first, prompts)
    first.close()
    tuned = tiny_model("llava-llama")
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "v_proj" in name:
                p.add_(0.01)
    other = LLMEngine(tuned, None, **kw)
    own = run(LLMEngine(tuned, None, num_kv_slots=4096), prompts[-4:])
    assert_same_outputs(run(other, prompts[-4:]), own)
    assert other.stats.cached_tokens_by_source.get("storage", 0) == 0


def test_an_oversized_file_named_like_a_page_is_never_read(llava, reference, tmp_path):
    model, prompts = llava[0], conversations()
    kw = dict(num_kv_slots=96, hicache_ratio=2, hicache_storage_dir=tmp_path)
    first = LLMEngine(model, None, **kw)
    run(first, prompts)
    first.close()
    for f in tmp_path.rglob("*.safetensors"):
        with open(f, "r+b") as out:
            out.truncate(1 << 30)  # sparse: 1 GiB on paper
    second = LLMEngine(model, None, **kw)
    assert_same_outputs(run(second, prompts[-4:]), reference[-4:])
    assert any("over" in n for n in second.tree_cache.storage.notices)


def test_a_match_that_raises_ends_its_requests_and_the_engine_serves_on(llava, monkeypatch):
    """A failure inside a request's admission (its match) must not leave the scheduler
    unable to finish it: the server's fail_unfinished then stopped the engine thread."""
    engine = LLMEngine(llava[0], None, num_kv_slots=96, hicache_ratio=2)
    tree = engine.tree_cache
    real = tree.match_prefix_for_req

    def fails_once(req, *a, **kw):
        monkeypatch.setattr(tree, "match_prefix_for_req", real)
        real(req, *a, **kw)  # the lock is taken, as a failure late in the match leaves it
        raise RuntimeError("injected")

    monkeypatch.setattr(tree, "match_prefix_for_req", fails_once)
    params = SamplingParams(max_new_tokens=2, stop_token_ids=())
    engine.add_request(GenerateRequest(conversations()[0], sampling_params=params))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    (out,) = engine.fail_unfinished(RuntimeError("the step failed"))
    assert out.finish_reason == "error"
    engine.check_invariants()
    assert tree.protected_size() == 0
    again = engine.generate([GenerateRequest(conversations()[0], sampling_params=params)])
    assert len(again[0].token_ids) == 2


@pytest.mark.parametrize(
    "settings",
    [
        dict(hicache_ratio=10**400),
        dict(hicache_ratio=1e300),
        dict(hicache_ratio=float("nan")),
        dict(hicache_ratio=2, hicache_storage_dir="/tmp/x\0y"),
        dict(hicache_write_policy="write_back"),  # no host tier
    ],
)
def test_more_bad_tier_settings_are_typed_errors(llava, settings):
    with pytest.raises(InvalidArgumentError, match="hicache"):
        LLMEngine(llava[0], None, num_kv_slots=96, **settings)


def test_numpy_ratios_work_and_a_refused_engine_leaves_no_writer_thread(llava, tmp_path):
    import threading

    LLMEngine(llava[0], None, num_kv_slots=96, hicache_ratio=np.float32(1.5))
    LLMEngine(llava[0], None, num_kv_slots=96, hicache_ratio=np.int64(2))
    writers = lambda: [t for t in threading.enumerate() if t.name == "minirad-hicache-writer"]  # noqa: E731
    before = len(writers())
    for _ in range(3):
        with pytest.raises(InvalidArgumentError):
            LLMEngine(
                llava[0],
                None,
                num_kv_slots=96,
                hicache_ratio=2,
                hicache_storage_dir=tmp_path,
                hicache_write_policy="bogus",
            )
    assert len(writers()) == before
