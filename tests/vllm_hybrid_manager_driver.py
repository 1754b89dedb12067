"""Drive the real vLLM 0.32 ``KVCacheManager`` (no model, no engine) through scripted traces,
as its scheduler would, and write what it answered at every step.

Runs in the vLLM venv (``make vllm``), started by ``tests/test_vllm_hybrid.py``::

    .venv-vllm/bin/python tests/vllm_hybrid_manager_driver.py CASES_JSON OUT_JSON

Each case of ``CASES_JSON`` gives a block size, a pool size (null block included), a
retention interval, the KV-cache groups (``{"layers", "window"}``, window 0 for full
attention) and operations:

- ``["new", rid, prompt ids, chunk]``: look the prompt up, allocate its first chunk;
- ``["step", rid, token]``: the next prefill chunk, or (prompt done) append ``token`` and
  allocate its slot; a failed allocation preempts (frees) the request;
- ``["free", rid]``.

After each operation the output records the lookup (hit, ``shared_prefix_boundary``), whether
the allocation succeeded, and every running request's block ids per group.
"""

from __future__ import annotations

import json
import sys


def run_case(case: dict) -> list:
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256)
    bs = case["block_size"]
    shape = {"block_size": bs, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    groups = [
        KVCacheGroupSpec(
            [f"layers.{i}" for i in g["layers"]],
            SlidingWindowSpec(**shape, sliding_window=g["window"])
            if g["window"]
            else FullAttentionSpec(**shape),
        )
        for g in case["groups"]
    ]
    config = KVCacheConfig(
        num_blocks=case["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=case["retention"],
    )
    manager = KVCacheManager(
        config, max_model_len=4096, scheduler_block_size=bs, hash_block_size=bs
    )
    hasher = get_request_block_hasher(bs, sha256)
    running: dict[str, tuple[Request, int]] = {}
    records = []
    for op in case["ops"]:
        record: dict = {}
        if op[0] == "new":
            _, rid, prompt, chunk = op
            request = Request(
                rid, prompt, SamplingParams(max_tokens=4096), None, block_hasher=hasher
            )
            blocks, hit, boundary = manager.get_computed_blocks(request)
            request.shared_prefix_boundary = boundary
            num_new = min(chunk, len(prompt) - hit)
            got = manager.allocate_slots(request, num_new, hit, blocks)
            record.update(hit=hit, boundary=boundary, ok=got is not None)
            if got is not None:
                request.num_computed_tokens = hit + num_new
                running[rid] = (request, chunk)
        elif op[1] not in running:  # ours and vLLM's disagreed earlier: say so
            record["missing"] = op[1]
        elif op[0] == "step":
            request, chunk = running[op[1]]
            if request.num_computed_tokens < request.num_prompt_tokens:
                num_new = min(chunk, request.num_prompt_tokens - request.num_computed_tokens)
            else:
                request.append_output_token_ids(op[2])
                num_new = 1
            got = manager.allocate_slots(request, num_new)
            record["ok"] = got is not None
            if got is None:
                manager.free(request)
                del running[op[1]]
            else:
                request.num_computed_tokens += num_new
        else:
            manager.free(running.pop(op[1])[0])
        record["tables"] = {rid: list(manager.get_block_ids(rid)) for rid in sorted(running)}
        records.append(record)
    return records


def main() -> None:
    cases_path, out_path = sys.argv[1:3]
    with open(cases_path) as f:
        cases = json.load(f)
    with open(out_path, "w") as f:
        json.dump([run_case(case) for case in cases], f)


if __name__ == "__main__":
    main()
