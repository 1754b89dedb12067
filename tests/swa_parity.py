"""Explicit request traces for the hybrid cache, replayed on our
:class:`~minirad.kvcache.swa_radix_cache.SWARadixCache` with the records the SGLang worker
(``minirad/bench/sglang_swa_worker.py``) writes for the same trace."""

from __future__ import annotations

import random

from minirad.errors import OutOfMemoryError
from minirad.kvcache.swa_radix_cache import ComponentType, SWARadixCache

FULL, SWA = ComponentType.FULL, ComponentType.SWA


def replay_ours(window: int, kv_size: int, ops: list, ratio: float = 1.0) -> list[dict]:
    """Our records for ``ops`` (the worker's trace format), invariants checked each step; the
    SWA pool is ``int(kv_size * ratio)`` slots (the worker's ``swa_size``)."""
    cache = SWARadixCache(kv_size, window, swa_full_tokens_ratio=ratio)
    last = []  # the match of each start, kept even when its allocation then fails
    match = cache.match_prefix
    cache.match_prefix = lambda key: last.append(match(key)) or last[-1]
    reqs = {}
    out = []
    for op in ops:
        rec: dict = {"op": op[0]}
        if op[0] == "start":
            try:
                req = cache.start_req(op[1], op[2])
            except OutOfMemoryError:
                m = last[-1]
                rec.update(match=len(m.indices), branching=m.swa_branching_seqlen, oom=True)
            else:
                reqs[op[1]] = req
                rec.update(match=req.cache_protected_len, branching=req.swa_branching_seqlen)
        elif op[0] == "evict":
            cache.evict(op[1], op[2])
        elif op[1] not in reqs:
            rec["skipped"] = True  # a request whose start found no memory
        else:
            req = reqs[op[1]]
            if op[0] == "decode":
                try:
                    cache.decode(req, op[2])
                except OutOfMemoryError:
                    rec["oom"] = True
            elif op[0] == "free_window":
                cache.free_out_of_window_slots(req)
            elif op[0] == "unfinished":
                before = req.cache_protected_len
                cache.cache_unfinished_req(req)
                if req.cache_protected_len > before:
                    rec["rematch"] = req.cache_protected_len
            else:
                cache.cache_finished_req(req)
                del reqs[op[1]]
        cache.check_invariants()
        rec["sizes"] = {
            "full": [cache.evictable_size(FULL), cache.protected_size(FULL)],
            "swa": [cache.evictable_size(SWA), cache.protected_size(SWA)],
        }
        rec["tombstones"] = [list(t) for t in cache.tombstones()]
        rec["free"] = list(cache.pools.available())
        out.append(rec)
    return out


def scripted_trace(window: int = 4) -> list:
    """Windows decide: a 20-token system prompt, prompts over 3 windows long, decode past the
    window with out-of-window frees, a branch at the system prompt (inside a tombstone: a
    miss and an early insert), the same branch again (a hit), an eviction per component."""
    sys_prompt = list(range(100, 120))
    ops: list = [["start", "a", sys_prompt + [1, 2, 3]]]
    for t in range(10):
        ops += [["decode", "a", 500 + t], ["free_window", "a"]]
    ops += [["finish", "a"], ["start", "b", sys_prompt + [9, 9]], ["unfinished", "b"]]
    for t in range(6):
        ops += [["decode", "b", 600 + t], ["free_window", "b"]]
    ops += [["start", "c", sys_prompt + [9, 9, 600, 601, 7]], ["finish", "b"]]
    ops += [["start", "d", sys_prompt + [5]], ["finish", "c"], ["evict", 0, 6]]
    ops += [["finish", "d"], ["evict", 8, 0], ["start", "e", sys_prompt + [1, 2, 3, 500]]]
    ops += [["finish", "e"], ["evict", 0, 100], ["evict", 100, 0]]
    return ops


def random_trace(seed: int, n_requests: int = 50) -> list:
    """``n_requests`` requests over a shared system prompt, branching from earlier sequences
    at random offsets, decoding past the window, inserting early, finishing, with evictions."""
    rng = random.Random(seed)
    sys_prompt = list(range(100, 112))
    seqs = [sys_prompt]
    running: dict[str, list[int]] = {}
    ops: list = []
    started = 0
    while started < n_requests or running:
        kind = rng.choice(["start", "start", "decode", "decode", "unfinished", "finish", "evict"])
        if kind == "start" and started < n_requests:
            base = rng.choice(seqs)
            prompt = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(4) for _ in range(rng.randint(1, 6))
            ]
            rid = f"r{started}"
            started += 1
            ops.append(["start", rid, prompt])
            running[rid] = list(prompt)
        elif kind == "evict":
            ops.append(["evict", rng.randrange(12), rng.randrange(12)])
        elif running:
            rid = rng.choice(sorted(running))
            if kind == "decode":
                for _ in range(rng.randint(1, 6)):
                    tok = rng.randrange(4)
                    ops += [["decode", rid, tok], ["free_window", rid]]
                    running[rid].append(tok)
            elif kind == "unfinished":
                ops.append(["unfinished", rid])
            else:
                ops.append(["finish", rid])
                seqs.append(running.pop(rid))
        elif kind in ("decode", "unfinished", "finish") and started >= n_requests:
            break
    return ops
