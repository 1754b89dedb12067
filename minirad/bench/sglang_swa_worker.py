"""Replay a request trace on the real SGLang 0.5.23's ``UnifiedRadixCache`` with components
(FULL, SWA), in-process on the CPU; JSON in (stdin), JSON out (stdout).

Run as ``.venv-sglang/bin/python -P minirad/bench/sglang_swa_worker.py < trace.json``, never
imported: it needs SGLang (its test kit builds the cache, pools and allocator; the kit's
``get_device`` is patched to ``"cpu"``) and imports none of minirad. The trace is the explicit
form of what ``tests/test_swa_sglang_parity.py`` drives through our
:class:`minirad.kvcache.swa_radix_cache.SWARadixCache`, with the same request lifecycle written
here over SGLang's own primitives: ``match_prefix``, ``lock``/``unlock`` (path + window lock),
``insert`` (which frees duplicate slots and recovers tombstones itself) with
``prev_prefix_len`` and the SWA ``evicted_seqlen``, ``evict`` with per-component token counts,
and the allocator's ``alloc``/``free``/``free_swa``.

Input: ``{"traces": [trace, ...]}`` (output: a list of record lists, one per trace, each on a
fresh cache), a trace being ``{"window": int, "kv_size": int, "swa_size": int, "ops": [...]}``
(``swa_size`` defaults to ``kv_size``), each op one of ``["start", rid, prompt]``,
``["decode", rid, token]``, ``["free_window", rid]``, ``["unfinished", rid]``,
``["finish", rid]``, ``["evict", full_tokens, swa_tokens]``.
Output: one record per op: ``{"op", "match", "branching", "oom", "rematch", "skipped",
"sizes": {"full": [evictable, protected], "swa": [...]}, "tombstones": [[start, end], ...],
"free": [full, swa]}``: ``match`` and ``branching`` for a start, ``oom`` where an allocation
failed, ``rematch`` the new protected length after an early insert, ``skipped`` for an op of a
request whose start ran out of memory.
"""

from __future__ import annotations

import json
import sys
from array import array
from types import SimpleNamespace


def _sglang() -> SimpleNamespace:
    """What the replay uses of SGLang (imported here: this file is never imported by minirad),
    with its test kit's ``get_device`` patched to the CPU."""
    import sglang.test.kits.unified_radix_cache.fixtures as fx
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    fx.get_device = lambda: "cpu"
    return SimpleNamespace(
        fx=fx,
        torch=torch,
        EvictParams=EvictParams,
        InsertParams=InsertParams,
        RadixKey=RadixKey,
        ComponentType=ComponentType,
        CacheConfig=CacheConfig,
    )


def main() -> None:
    spec = json.load(sys.stdin)
    traces = spec["traces"] if "traces" in spec else [spec]
    sg = _sglang()
    json.dump([replay(t, sg) for t in traces], sys.stdout)


def replay(spec: dict, sg: SimpleNamespace) -> list[dict]:
    """One trace on a fresh cache: its records."""
    fx, torch, ComponentType = sg.fx, sg.torch, sg.ComponentType
    EvictParams, InsertParams, RadixKey = sg.EvictParams, sg.InsertParams, sg.RadixKey
    window = spec["window"]
    cfg = sg.CacheConfig(
        page_size=1,
        components=(ComponentType.FULL, ComponentType.SWA),
        num_layers=6,
        full_attention_layer_ids=(5,),
        sliding_window_size=window,
        kv_size=spec["kv_size"],
        max_num_reqs=64,
        max_context_len=4096,
        head_num=1,
        head_dim=8,
        dtype=torch.float32,
    )
    # The kit sizes the SWA pool as the full one; SGLang's server sizes it by
    # --swa-full-tokens-ratio: give both pools the SWA size asked for.
    swa_size = spec.get("swa_size", spec["kv_size"])
    pool_cls, alloc_cls = fx.SWAKVPool, fx.SWATokenToKVPoolAllocator
    fx.SWAKVPool = lambda **kw: pool_cls(**{**kw, "size_swa": swa_size})
    fx.SWATokenToKVPoolAllocator = lambda **kw: alloc_cls(**{**kw, "size_swa": swa_size})
    try:
        cache, alloc, _ = fx.build_fixture(cfg)
    finally:
        fx.SWAKVPool, fx.SWATokenToKVPoolAllocator = pool_cls, alloc_cls
    swa = ComponentType.SWA
    reqs: dict[str, dict] = {}

    def tensor(xs):
        return torch.tensor(xs, dtype=torch.int64)

    def allocate(n: int):
        short_full = max(0, n - alloc.full_available_size())
        short_swa = max(0, n - alloc.swa_available_size())
        if short_full or short_swa:
            cache.evict(EvictParams(num_tokens=short_full, swa_num_tokens=short_swa))
        if n > alloc.full_available_size() or n > alloc.swa_available_size():
            return None
        return alloc.alloc(n).tolist() if n else []

    def free_window(r: dict, pre_len: int) -> None:
        threshold = pre_len - window
        if threshold < r["evicted"] + 1:
            return
        start = max(r["evicted"], r["protected"])
        if threshold > start:
            alloc.free_swa(tensor(r["kv"][start:threshold]))
        r["evicted"] = max(start, threshold)

    def insert_len(r: dict, n: int) -> int:
        b = r["branching"]
        if b is not None and max(r["protected"], r["evicted"]) < b <= n:
            return b
        return n

    def do_insert(r: dict, n: int):
        params = InsertParams(
            key=RadixKey(array("q", r["tokens"][:n])),
            value=tensor(r["kv"][:n]),
            prev_prefix_len=r["protected"],
        )
        params.set_evicted_seqlen(swa, r["evicted"])
        return cache.insert(params)

    def tombstones() -> list[list[int]]:
        out, stack = [], [(cache.root_node_handle(), 0)]
        while stack:
            node, depth = stack.pop()
            for child in fx.node_children(cache, node):
                n = fx.node_key_length(cache, child)
                if fx.node_device_value(cache, child, swa) is None:
                    out.append([depth, depth + n])
                stack.append((child, depth + n))
        return sorted(out)

    records = []
    for op in spec["ops"]:
        rec: dict = {"op": op[0]}
        if op[0] == "start":
            rid, prompt = op[1], op[2]
            m = fx.match_prefix(cache, prompt)
            r = {
                "tokens": list(prompt),
                "kv": cache.path_device_indices(m.last_device_node).tolist(),
                "protected": m.device_prefix_len,
                "node": m.last_device_node,
                "evicted": 0,
                "branching": m.swa_branching_seqlen,
            }
            r["lock"] = cache.lock(r["node"])
            rec.update(match=m.device_prefix_len, branching=m.swa_branching_seqlen)
            own = allocate(len(prompt) - m.device_prefix_len)
            if own is None:
                cache.unlock(r["lock"])
                rec["oom"] = True
            else:
                r["kv"] += own
                reqs[rid] = r
        elif op[0] == "evict":
            cache.evict(EvictParams(num_tokens=op[1], swa_num_tokens=op[2]))
        elif op[1] not in reqs:
            rec["skipped"] = True  # a request whose start found no memory
        else:
            r = reqs[op[1]]
            if op[0] == "decode":
                own = allocate(1)
                if own is None:
                    rec["oom"] = True
                else:
                    r["kv"] += own
                    r["tokens"].append(op[2])
            elif op[0] == "free_window":
                free_window(r, len(r["kv"]) - 1)
            elif op[0] == "unfinished":
                n = insert_len(r, len(r["kv"]))
                free_window(r, n - 1)
                if n > r["protected"]:
                    result = do_insert(r, n)
                    node = result.last_device_node
                    new = cache.path_device_indices(node).tolist()
                    rec["rematch"] = len(new)
                    cache.unlock(r["lock"])
                    r["kv"][: len(new)] = new
                    r["node"], r["protected"] = node, len(new)
                    r["lock"] = cache.lock(node)
                    if n < len(r["kv"]):  # cut at the branching point
                        r["branching"] = None
                        free_window(r, len(r["kv"]) - 1)
            else:  # finish
                n = insert_len(r, len(r["kv"]))
                if n > r["protected"]:
                    do_insert(r, n)
                tail = r["kv"][max(n, r["protected"]) :]
                if tail:
                    alloc.free(tensor(tail))
                cache.unlock(r["lock"])
                del reqs[op[1]]
        rec["sizes"] = {
            "full": [cache.full_evictable_size(), cache.full_protected_size()],
            "swa": [cache.swa_evictable_size(), cache.swa_protected_size()],
        }
        rec["tombstones"] = tombstones()
        rec["free"] = [alloc.full_available_size(), alloc.swa_available_size()]
        records.append(rec)
    return records


if __name__ == "__main__":
    main()
