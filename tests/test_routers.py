"""Two real ``minirad serve`` workers behind the real routers (sglang-router, vllm-router).

Every process is started and stopped here, on 127.0.0.1. What each worker did is read from its
own ``/metrics`` and ``usage.prompt_tokens_details.cached_tokens``, never from the router.
Skipped without ``make routers``, except in CI.
"""

from __future__ import annotations

import json
import os
import time

import pytest

import viz
from minirad.bench.common import make_prompts
from minirad.bench.replicas import format_table, run_route
from minirad.cluster.replicas import (
    MiniradWorker,
    Router,
    parse_counters,
    send_routed,
    worker_counters,
)
from minirad.errors import InvalidArgumentError, PeerError
from minirad.kv_events import AllBlocksCleared, BlockStored
from minirad.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("router_venv")


@pytest.fixture(scope="module")
def workers():
    """Two workers publishing KV events, one per core where there are two."""
    pin = (os.cpu_count() or 1) >= 2
    pair = [MiniradWorker(cpus=[i] if pin else None, kv_events=True) for i in range(2)]
    try:
        for w in pair:
            w.start(timeout_s=120)
        yield pair
    finally:
        for w in pair:
            w.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompts(tokenizer, num_requests=24, num_system_prompts=4, seed=1)


def _cached(worker: MiniradWorker, prompt) -> int:
    body = {"model": worker.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    return worker.post("/v1/completions", body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_sglang_router_registers_our_workers_under_their_model(workers):
    """Our /server_info and /model_info are what sglang-router reads (vLLM's workers, which
    lack them, are registered as model "unknown")."""
    with Router("sglang", workers) as router:
        listed = json.loads(router.get_text("/workers"))["workers"]
        models = json.loads(router.get_text("/v1/models"))["data"]
    assert sorted(w["url"] for w in listed) == sorted(w.base_url for w in workers)
    assert {w["model_id"] for w in listed} == {m["id"] for m in models} == {"minirad-tiny-llava"}


def test_round_robin_splits_the_requests(workers, prompts):
    run = run_route(workers, "sglang:round_robin", prompts[:8], concurrency=1)
    assert run.requests == [4, 4]
    assert all(c.generation_tokens == 4 * 4 for c in run.counters)  # ignore_eos: 4 each


def test_cache_aware_keeps_each_prefix_on_one_worker(workers, prompts):
    """Under concurrency, sglang's cache_aware sends every request of a system prompt to the
    worker that has it, and so caches at least as much as round robin."""
    aware = run_route(workers, "sglang:cache_aware", prompts, concurrency=4)
    systems = sorted({p.split("\nQ: ")[0] for p in prompts})
    holders = []
    for system in systems:  # which worker's cache holds it (the probe adds it to one more)
        holders.append([_cached(w, system) >= 192 for w in workers].count(True))
    assert holders == [1] * len(systems), format_table([aware], ["minirad", "minirad"])
    robin = run_route(workers, "sglang:round_robin", prompts, concurrency=4)
    assert aware.hit_rate >= robin.hit_rate, format_table([aware, robin], ["minirad"] * 2)
    assert sum(aware.requests) == sum(robin.requests) == len(prompts)


def test_cache_aware_piles_light_traffic_onto_one_worker(workers, prompts):
    """One client at a time: a miss goes to the least-loaded worker, and at load 0 the same
    worker always wins (the pile-up the chapter measures)."""
    run = run_route(workers, "sglang:cache_aware", prompts, concurrency=1)
    assert sorted(run.requests) == [0, len(prompts)]


def test_kv_aware_routes_by_our_workers_events(workers, prompts, tokenizer):
    """vllm-router's kv_aware follows what the caches hold, as their KV events tell it: each
    worker is primed behind the router's back with another system prompt, and every request
    then goes to the worker holding its prompt."""
    systems = sorted({p.split("\nQ: ")[0] for p in prompts})[:2]
    for w in workers:
        assert w.reset_prefix_cache()
    with Router("vllm", workers, "kv_aware") as router:
        for w, system in zip(workers, systems, strict=True):  # not through the router
            assert _cached(w, tokenizer(system)["input_ids"]) == 0
        time.sleep(1.0)  # the BlockStored events reach the router
        before = [worker_counters(w) for w in workers]
        for k in (1, 0, 1, 0):  # the second prompt first: no first-worker tie-break passes
            ids = tokenizer(f"{systems[k]}\nQ: what is cached?\nA:")["input_ids"]
            body = {"model": workers[0].model_name, "prompt": ids, "max_tokens": 2}
            router.post("/v1/completions", body | {"temperature": 0})
        served = [worker_counters(w) - b for w, b in zip(workers, before, strict=True)]
    assert [round(c.requests) for c in served] == [2, 2]
    for c in served:  # each request found its system prompt's blocks
        assert c.hits >= 2 * 192


def test_router_arguments_are_checked(workers):
    with pytest.raises(InvalidArgumentError, match="no policy 'kv_aware'"):
        Router("sglang", workers, "kv_aware")
    with pytest.raises(InvalidArgumentError, match="router must be one of"):
        Router("nginx", workers)
    silent = MiniradWorker()  # not started: only its settings are read
    with pytest.raises(InvalidArgumentError, match="kv_aware needs KV events"):
        Router("vllm", [silent], "kv_aware")


def test_metrics_without_vllm_counters_are_refused():
    with pytest.raises(PeerError, match="lack vllm:prefix_cache_queries_total"):
        parse_counters("# TYPE up gauge\nup 1.0\n")


def test_a_worker_that_cannot_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model folder that does not load
    with pytest.raises(PeerError, match="exited with code"):
        MiniradWorker(tmp_path).start(timeout_s=60)


def test_the_workload_shares_four_system_prompts_of_seven_blocks(tokenizer):
    prompts = make_prompts(tokenizer, seed=0)
    assert prompts == make_prompts(tokenizer, seed=0) != make_prompts(tokenizer, seed=1)
    systems = {p.split("\nQ: ")[0] for p in prompts}
    assert len(prompts) == 40 and len(systems) == 4
    for system in systems:
        assert 224 <= len(tokenizer(system)["input_ids"]) < 256  # 7 full blocks of 32
    for p in prompts:  # each prompt's tokens begin with its system prompt's
        system = tokenizer(p.split("\nQ: ")[0])["input_ids"]
        assert tokenizer(p)["input_ids"][:224] == system[:224]
    with pytest.raises(InvalidArgumentError, match="num_requests must be a positive int"):
        make_prompts(tokenizer, num_requests=0)


def test_a_router_waits_for_its_workers_and_says_which_is_down(workers):
    down = MiniradWorker()  # never started
    router = Router("sglang", [workers[0], down])
    with pytest.raises(PeerError, match=f"1 of 2 workers healthy.*{down.base_url}"):
        router.start(timeout_s=8)
    assert not router.running
    with pytest.raises(InvalidArgumentError, match="listed twice"):
        Router("sglang", [workers[0], workers[0]])


def _blocks(ids: list[int], size: int = 32) -> set[tuple[int, ...]]:
    return {tuple(ids[k : k + size]) for k in range(0, len(ids) - size + 1, size)}


def test_send_routed_and_the_replica_view_follow_the_routers_choice(workers, prompts, tokenizer):
    """Round robin through the real router: send_routed names the worker that served each
    request, from the workers' counters, and each tree of the view holds exactly the blocks
    of the prompts its replica was sent (what its own KV events said)."""
    for w in workers:
        assert w.reset_prefix_cache()
    with Router("sglang", workers, "round_robin") as router:
        view = viz.watch_replicas(router.workers)
        try:
            for p in prompts[:6]:
                body = {"model": workers[0].model_name, "prompt": p, "max_tokens": 1}
                view.send(router, body | {"temperature": 0})
            again = {"model": workers[0].model_name, "prompt": prompts[4], "max_tokens": 1}
            routed = send_routed(router, again | {"temperature": 0})
        finally:
            view.stop()
    chosen = [r.replica for r in view.routes]
    assert sorted(chosen) == [0, 0, 0, 1, 1, 1] and chosen[::2] == [chosen[0]] * 3
    # The seventh request: the turn comes round to the worker that served the fifth prompt,
    # sent again, and it finds its blocks.
    assert routed.worker == chosen[4] == chosen[0]
    assert routed.cached_tokens >= 224
    for i, tree in enumerate(view.views):
        sent = set().union(
            *(
                _blocks(tokenizer(p)["input_ids"])
                for p, r in zip(prompts[:6], view.routes, strict=True)
                if r.replica == i
            )
        )
        held: set = set()  # the blocks since the reset (the replay socket sends older ones)
        for _, batch in tree.batches:
            for e in batch.events:
                if isinstance(e, AllBlocksCleared):
                    held = set()
                elif isinstance(e, BlockStored):
                    held |= _blocks(e.token_ids)
        assert held == sent


def test_kv_aware_credits_a_workers_host_copies(prompts, tokenizer):
    """Issue 32: with a host tier, a worker publishes its device blocks as "GPU" and their
    host copies as "CPU"; vllm-router credits the CPU ones (at 0.8) and so still routes a
    prompt to the worker whose host holds it, after its device let it go. Worker 1 (never
    the tie-break's choice) is primed with a system prompt, which two others then push off
    its small device pool, behind the router's back."""
    systems = sorted({p.split("\nQ: ")[0] for p in prompts})
    tiers = ["--enable-hierarchical-cache", "--hicache-ratio", "4"]
    pair = [MiniradWorker(kv_events=True, num_kv_slots=320, extra_args=tiers) for _ in range(2)]
    try:
        for w in pair:
            w.start(timeout_s=120)
        with Router("vllm", pair, "kv_aware") as router:
            for system in systems[:3]:  # the first one ends on worker 1's host only
                _cached(pair[1], tokenizer(system)["input_ids"])
            time.sleep(1.0)  # the events reach the router
            ids = tokenizer(f"{systems[0]}\nQ: what is cached?\nA:")["input_ids"]
            body = {"model": pair[0].model_name, "prompt": ids, "max_tokens": 1, "temperature": 0}
            before = [worker_counters(w) for w in pair]
            usage = router.post("/v1/completions", body)["usage"]
            served = [worker_counters(w) - b for w, b in zip(pair, before, strict=True)]
    finally:
        for w in pair:
            w.stop()
    assert [round(c.requests) for c in served] == [0, 1]
    by_source = usage["prompt_tokens_details"]["cached_tokens_by_source"]
    assert by_source["host"] >= 192 and by_source["device"] == 0
