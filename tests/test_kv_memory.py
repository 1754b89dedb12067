"""An engine run never holds more KV than its configured pool.

The shipped tiny LLaVA serves a workload that needs far more KV than the pool holds (more
requests in flight than fit at once, and more distinct prefixes than the tree can keep), so
the engine must evict and preempt. After every step the allocator's slots are checked
against the pool and accounted for, one by one, by the radix tree and the running requests;
the physical KV tensor has exactly the configured number of slots. Nothing is timed.
"""

import random

import pytest
import torch
from tiny_models import bytes_per_token

from minirad.course.scenes import DEFAULT_IMAGE_SIZE, random_scene, render
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.events import EvictEvent
from minirad.models import DEFAULT_MODEL_DIR, load_model

MAX_NEW = 24
QUESTIONS = ("Describe the image.", "What colour is the circle?", "How many shapes are there?")
TEMPLATE = "<|im_start|>user\n<image>\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def shipped():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model(DEFAULT_MODEL_DIR)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def requests():
    """4 images x 3 questions: 12 prompts of about 80 tokens, 4 distinct image prefixes."""
    rng = random.Random(0)
    images = [render(random_scene(rng, DEFAULT_IMAGE_SIZE)) for _ in range(4)]
    # No stop token: every answer grows to MAX_NEW, so running requests outgrow the pool.
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=())
    return [GenerateRequest(TEMPLATE.format(q), [im], params) for im in images for q in QUESTIONS]


def check_pool(engine: LLMEngine, num_kv_slots: int) -> int:
    """Every allocated page is held by exactly one owner: the tree or one running request
    (waiting ones hold none), and no slot lies outside the pool. Returns the slots in use."""
    alloc, tree, sched = engine.allocator, engine.tree_cache, engine.scheduler
    ps = alloc.page_size
    used = alloc.used_size()
    assert alloc.size == num_kv_slots
    assert 0 <= used <= num_kv_slots
    assert used <= alloc.peak_used_size <= num_kv_slots
    allocated = {p for p in range(num_kv_slots // ps) if alloc.is_allocated(p * ps)}
    assert len(allocated) * ps == used
    tree_slots = tree.all_values_flatten()
    assert len(tree_slots) == tree.evictable_size() + tree.protected_size()
    owned = {s // ps for s in tree_slots}
    assert len(owned) * ps == len(tree_slots)  # the tree holds whole pages
    for r in sched.running:
        assert all(0 <= s < num_kv_slots for s in r.kv_indices)
        assert {s // ps for s in r.kv_indices[: r.cache_protected_len]} <= owned
        private = {s // ps for s in r.kv_indices[r.cache_protected_len :]}
        assert not private & owned, f"{r.rid}: a page held twice"
        owned |= private
    for r in sched.waiting:
        assert not r.kv_indices
    assert owned == allocated
    engine.check_invariants()
    return used


def run_checked(model, processor, requests, **config):
    """Every request submitted at once, the pool checked after every step. Returns the
    answers, the most slots seen in use after a step, the evictions and the engine."""
    engine = LLMEngine(model, processor, **config)
    evictions = []
    engine.bus.subscribe(lambda e: evictions.append(e) if isinstance(e, EvictEvent) else None)
    rids = [engine.add_request(r) for r in requests]
    answers, most = {}, check_pool(engine, config["num_kv_slots"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                answers[out.rid] = out.token_ids
        most = max(most, check_pool(engine, config["num_kv_slots"]))
    return [answers[r] for r in rids], most, evictions, engine


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_run_never_exceeds_its_pool(shipped, requests, page_size):
    model, processor = shipped
    num_kv_slots = 192  # two requests of ~100 tokens fit at once; four run
    answers, most, evictions, engine = run_checked(
        model, processor, requests, num_kv_slots=num_kv_slots, page_size=page_size, max_num_seqs=4
    )
    prompts = [engine.input_processor.process(r.prompt, r.images) for r in requests]
    demand = sum(len(p.prompt_token_ids) + MAX_NEW for p in prompts)
    assert demand > 4 * num_kv_slots  # the workload needs several pools' worth of KV
    assert engine.stats.num_preemptions > 0 and evictions  # so the engine had to make room
    peak = engine.allocator.peak_used_size
    assert most <= peak <= num_kv_slots
    # The physical tensor: exactly the configured slots, each of bytes_per_token.
    kv = engine.kv_cache
    assert kv.num_slots == num_kv_slots and kv.block_size == page_size
    assert kv.bytes_per_token == bytes_per_token(model)
    tensor_bytes = sum(t.numel() * t.element_size() for t in (kv.k_cache, kv.v_cache))
    assert tensor_bytes == kv.nbytes == num_kv_slots * kv.bytes_per_token
    # Evicting and preempting changes no answer (greedy): a pool that holds everything.
    roomy_pool = -(-demand // page_size) * page_size
    roomy, _, none_evicted, _ = run_checked(
        model, processor, requests, num_kv_slots=roomy_pool, page_size=page_size, max_num_seqs=4
    )
    assert not none_evicted
    assert answers == roomy
