"""The hybrid prefix cache against the real vLLM 0.32 (``make vllm``; skipped without it,
except in CI).

A tiny random ``Gemma3ForCausalLM`` (6 layers: 5 sliding, window 32, then 1 full; built here
with Hugging Face, offline) serves the scripted trace of ``shared/reference/hybrid-caches.md``
one request at a time, block size 32, with vLLM's hybrid KV-cache manager on and off
(``tests/vllm_hybrid_trace.py``, about a minute on 2 cores). Our ``KVCacheManager``, given the
same layer specs and fed the same prompt and output ids, must group the layers as vLLM did and
find the same ``num_cached_tokens`` for every request, in both modes. Why each number is what
it is: ``tests/test_hybrid_kv_cache.py``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from minirad.kvcache.kv_cache_groups import get_kv_cache_groups
from minirad.kvcache.kv_cache_manager import KVCacheManager, serve_one_at_a_time
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec

SCRIPT = Path(__file__).with_name("vllm_hybrid_trace.py")
WINDOW, HEAD_DIM, BLOCK = 32, 32, 32
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def build_tiny_gemma3(out: Path) -> Path:
    """A random 6-layer Gemma 3 text model (290k parameters), saved for vLLM to load."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        max_position_embeddings=512,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(out)
    return out


def layer_specs() -> list:
    """Our specs for the model's layers (one KV head of 32, float32)."""
    full = FullAttentionSpec(BLOCK, 1, HEAD_DIM, torch.float32)
    sliding = SlidingWindowSpec(BLOCK, 1, HEAD_DIM, torch.float32, sliding_window=WINDOW)
    return [sliding if t == "sliding_attention" else full for t in LAYER_TYPES]


def trace_prompts() -> list[list[int]]:
    """A (200 tokens), A + 50, A, two prompts sharing only A's first 40 tokens, A."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    a = tokens(200)
    return [a, a + tokens(50), a, a[:40] + tokens(160), a[:40] + tokens(160), a]


def test_our_manager_finds_the_real_vllm_cached_tokens_hybrid_on_and_off(vllm_python, tmp_path):
    model = build_tiny_gemma3(tmp_path / "tiny-gemma3")
    prompts = trace_prompts()
    trace, out = tmp_path / "trace.json", tmp_path / "out.json"
    trace.write_text(json.dumps({"prompts": prompts, "max_tokens": 8}))
    run = subprocess.run(
        [str(vllm_python), str(SCRIPT), str(model), str(trace), str(out)],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    theirs = json.loads(out.read_text())
    print({mode: round(r["seconds"], 1) for mode, r in theirs.items()}, file=sys.stderr)

    for mode, disable in (("hybrid", False), ("disabled", True)):
        groups = get_kv_cache_groups(layer_specs(), disable_hybrid=disable)
        mine = [{"layers": list(g.layer_ids), "spec": type(g.spec).__name__} for g in groups]
        assert mine == theirs[mode]["groups"], mode
        rows = theirs[mode]["rows"]
        assert all(len(r["output"]) == 8 for r in rows)
        manager = KVCacheManager(
            4096, BLOCK, layer_specs=layer_specs(), disable_hybrid_kv_cache_manager=disable
        )
        requests = [(p, r["output"], ()) for p, r in zip(prompts, rows, strict=True)]
        assert serve_one_at_a_time(manager, requests) == [r["cached"] for r in rows], mode
        manager.check_invariants()
    # The numbers measured in shared/reference/hybrid-caches.md.
    assert [r["cached"] for r in theirs["hybrid"]["rows"]] == [0, 192, 192, 0, 32, 192]
    assert [r["cached"] for r in theirs["disabled"]["rows"]] == [0, 192, 192, 32, 32, 192]


# ---------------------------------------------------------------------- the manager itself
DRIVER = Path(__file__).with_name("vllm_hybrid_manager_driver.py")
STEMS = [[random.Random(s).randrange(1, 50) for _ in range(40)] for s in range(3)]
LAYOUTS = [  # (window per layer, 0 for full attention), block size 4
    [8, 8, 0],  # two sliding groups and a full one: the simple hybrid
    [8, 13, 0],  # two windows: the fixed point may take several rounds
    [6, 6],  # one sliding group: the unitary coordinator
]


def spec_of(window: int, block_size: int = 4):
    if window:
        return SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=window)
    return FullAttentionSpec(block_size, 1, 8, torch.float32)


def record_of(manager: KVCacheManager, running: dict, **lookup) -> dict:
    tables = {rid: [list(t) for t in manager.get_block_ids(rid)] for rid in sorted(running)}
    return {**lookup, "tables": tables}


def random_case(seed: int) -> tuple[dict, list[dict]]:
    """A random trace on a small pool, and our manager's answers at every step."""
    rng = random.Random(seed)
    windows = LAYOUTS[seed % len(LAYOUTS)]
    retention = rng.choice([0, 0, None, 16])
    case = {"block_size": 4, "num_blocks": rng.randrange(8, 40), "retention": retention}
    groups = get_kv_cache_groups([spec_of(w) for w in windows])
    case["groups"] = [
        {"layers": list(g.layer_ids), "window": windows[g.layer_ids[0]]} for g in groups
    ]
    manager = KVCacheManager(
        case["num_blocks"], 4, kv_cache_groups=groups, prefix_cache_retention_interval=retention
    )
    running: dict[str, dict] = {}
    ops, records = [], []
    for n in range(40):
        kind = rng.choices(["new", "step", "free"], [5, 8, 2])[0] if running else "new"
        if kind == "new":
            stem, shared = rng.randrange(3), rng.choice([9, 16, 23, 40, rng.randrange(41)])
            prompt = STEMS[stem][:shared] + [
                rng.randrange(50, 60) for _ in range(rng.choice([0, 3, 12]))
            ]
            prompt = prompt if len(prompt) >= 2 else [1, 2]
            chunk, rid = rng.choice([3, 8, 64]), f"r{n}"
            ops.append(["new", rid, prompt, chunk])
            blocks, hit, boundary = manager.get_computed_blocks(prompt)
            got = manager.allocate_slots(
                rid, prompt, min(chunk, len(prompt) - hit), blocks, shared_prefix_boundary=boundary
            )
            if got is not None:
                running[rid] = {"tokens": list(prompt), "prompt": len(prompt), "chunk": chunk}
            records.append(
                record_of(manager, running, hit=hit, boundary=boundary, ok=got is not None)
            )
            continue
        rid = rng.choice(sorted(running))
        if kind == "free":
            ops.append(["free", rid])
            manager.free(rid)
            del running[rid]
            records.append(record_of(manager, running))
            continue
        req, token = running[rid], rng.randrange(1, 60)
        ops.append(["step", rid, token])
        done = manager.num_tokens[rid]
        if done < req["prompt"]:
            num_new = min(req["chunk"], req["prompt"] - done)
        else:
            req["tokens"].append(token)
            num_new = 1
        got = manager.allocate_slots(rid, req["tokens"], num_new)
        if got is None:
            manager.free(rid)
            del running[rid]
        records.append(record_of(manager, running, ok=got is not None))
        manager.check_invariants()
    case["ops"] = ops
    return case, records


def test_our_manager_answers_as_vllm_s_own_manager_step_by_step(vllm_python, tmp_path):
    """vLLM's ``KVCacheManager`` itself (its scheduler's calls, no model), on 60 random traces
    over small pools: the same hits and junctions, the same allocation failures, and the same
    block ids in every group's table after every step (null blocks, evictions and reuse
    order included)."""
    cases, ours = zip(*(random_case(seed) for seed in range(60)), strict=True)
    path, out = tmp_path / "cases.json", tmp_path / "out.json"
    path.write_text(json.dumps(cases))
    run = subprocess.run(
        [str(vllm_python), str(DRIVER), str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    theirs = json.loads(out.read_text())
    for seed, (mine, vllm) in enumerate(zip(ours, theirs, strict=True)):
        for step, (a, b) in enumerate(zip(mine, vllm, strict=True)):
            assert a == b, (seed, step, cases[seed]["ops"][step])
    assert sum(r.get("hit", 0) > 0 for case in ours for r in case) > 100
    assert sum(r.get("boundary", 0) > 0 for case in ours for r in case) > 10
    assert sum(r.get("ok") is False for case in ours for r in case) > 10  # full pools
