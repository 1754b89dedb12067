"""Exercises of chapter 11 (a hierarchical KV cache: device, host, disk).

The answers are computed here with the real ``minirad`` code: a
:class:`~minirad.kvcache.hiradix_cache.HiRadixCache` driven through the operations each exercise
describes (q1, q2, and q4 with a :class:`~minirad.kvcache.hicache_storage.HiCacheMemoryStorage`
as its disk tier), and the cost model of :mod:`minirad.kvcache.transfer_cost` (q3). Every
``Qn_SOLUTION`` is runnable code that sets ``answer``; the tests run it and check it with
``qn``, and compute the answers another way (the tiers' rules applied by hand to plain lists,
the break-even length from the two costs compared token by token).

Usage in the notebook::

    from minirad.exercises.ch11 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools
import math

from minirad.exercises import Exercise, WrongAnswer, is_int, wrong_type
from minirad.kvcache.hicache_storage import HiCacheMemoryStorage
from minirad.kvcache.hiradix_cache import WRITE_POLICIES, HiRadixCache
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.transfer_cost import TierLink, break_even_tokens, kv_bytes_per_token

__all__ = [
    "Q1_A",
    "Q1_B",
    "Q1_DEVICE",
    "Q1_QUERY",
    "Q2_A",
    "Q2_B",
    "Q3_LINK",
    "Q3_MODEL",
    "Q3_PREFILL",
    "Q4_M",
    "Q4_OTHER",
    "Q4_PAGE",
    "Q4_S",
    "Q4_T",
    "q1",
    "q2",
    "q3",
    "q4",
]


def _cache(size: int = 64, **kwargs) -> tuple[HiRadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(size)
    return HiRadixCache(token_to_kv_pool_allocator=alloc, **kwargs), alloc


def _put(cache: HiRadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> None:
    """Insert ``key`` as a finished request does: fresh slots, the duplicates given back."""
    value = alloc.alloc(len(key))
    alloc.free(value[: cache.insert(key, value)])


def _int_tuple(answer: object, names: tuple[str, ...]) -> tuple[int, ...]:
    if (
        not isinstance(answer, tuple | list)
        or len(answer) != len(names)
        or not all(map(is_int, answer))
    ):
        raise WrongAnswer(wrong_type(f"{len(names)} ints ({', '.join(names)})", answer))
    return tuple(int(a) for a in answer)


def _int_dict(answer: object, keys: tuple[str, ...], example: str) -> dict[str, int]:
    if not isinstance(answer, dict) or set(answer) != set(keys):
        raise WrongAnswer(wrong_type(f"a dict with the keys {list(keys)}, e.g. {example}", answer))
    bad = [k for k in keys if not is_int(answer[k])]
    if bad:
        raise WrongAnswer(wrong_type(f"an int for {bad[0]!r} (tokens)", answer[bad[0]]))
    return {k: int(answer[k]) for k in keys}


# ----------------------------------------------------------------------------------------- q1
Q1_DEVICE = 32  # device pool, tokens; the host pool is twice that
Q1_A = list(range(1, 17))
Q1_B = Q1_A[:10] + list(range(30, 36))
Q1_QUERY = Q1_B + [50, 51]


@functools.cache
def _q1() -> tuple[int, int]:
    cache, alloc = _cache(Q1_DEVICE, hicache_ratio=2)
    _put(cache, alloc, Q1_A)
    _put(cache, alloc, Q1_B)
    cache.match_prefix(Q1_A)
    cache.evict(4)
    m = cache.match_prefix(Q1_QUERY)
    return len(m.indices), m.host_hit_length


def _check_q1(answer: object) -> str | None:
    got = _int_tuple(answer, ("len(indices)", "host_hit_length"))
    expected = _q1()
    if got == expected:
        return None
    device, host = expected
    if got == (device, 0):
        return (
            "that is a RadixCache's answer, where an evicted leaf is gone; here B's tail had a "
            "host copy (write-through), so evict only demoted it"
        )
    if got == (device + host, 0):
        return (
            "match_prefix(A) made A's leaf the most recently used: the least recently used "
            "device leaf is B's tail, and evict(4) takes all of it (a node goes whole)"
        )
    if got == (host, device):
        return "swapped: the device part comes first on the path, the host-only part after it"
    if got[0] + got[1] == len(Q1_QUERY):
        return (
            f"the last {len(Q1_QUERY) - len(Q1_B)} tokens of the query were never inserted: "
            "no tier holds them"
        )
    return (
        "not that; draw the tree after the two inserts (where does B split A?), find the "
        "least recently used device leaf, and demote it"
    )


Q1_SOLUTION = """\
from minirad.kvcache.hiradix_cache import HiRadixCache
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator

alloc = TokenToKVPoolAllocator(32)
cache = HiRadixCache(token_to_kv_pool_allocator=alloc, hicache_ratio=2)
A = list(range(1, 17))
B = A[:10] + list(range(30, 36))
for key in (A, B):
    value = alloc.alloc(len(key))
    alloc.free(value[: cache.insert(key, value)])
cache.match_prefix(A)
cache.evict(4)
m = cache.match_prefix(B + [50, 51])
answer = (len(m.indices), m.host_hit_length)
# (10, 6): B splits A after 10 tokens. A was matched last, so B's 6-token tail is the least
# recently used device leaf; evict(4) takes it whole, and since it has a host copy
# (write-through) it is demoted, not deleted. The query walks the shared 10 tokens on the
# device, then B's tail on the host; 50 and 51 were never cached."""

q1 = Exercise(
    "q1 host hits",
    _check_q1,
    "Draw the tree after the inserts: B splits A after 10 tokens. Which device leaf was used "
    "least recently? Under write-through it has a host copy, so evict demotes it: the node "
    "stays, host-only.",
    Q1_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q2
Q2_A = list(range(1, 13))
Q2_B = Q2_A[:6] + list(range(20, 30))


@functools.cache
def _q2(policy: str, threshold: int = 2) -> int:
    cache, alloc = _cache(write_policy=policy, write_through_threshold=threshold)
    _put(cache, alloc, Q2_A)
    _put(cache, alloc, Q2_B)
    _put(cache, alloc, Q2_A)  # a second request over A's path
    cache.evict(6)
    return cache.host_size()


def _check_q2(answer: object) -> str | None:
    got = _int_dict(answer, WRITE_POLICIES, "{'write_through': 0, ...}")
    expected = {p: _q2(p) for p in WRITE_POLICIES}
    if got == expected:
        return None
    wt, sel, wb = (got[p] for p in WRITE_POLICIES)
    if wt != expected["write_through"]:
        return (
            "write_through: every insert backs up its whole path at once, and evict only "
            "demotes; count the distinct tokens of A and B"
        )
    if sel != expected["write_through_selective"]:
        if sel == expected["write_through"]:
            return (
                "write_through_selective backs a node up only once two requests have inserted "
                "it; B's own tokens were inserted once, and when evict takes B's leaf it has "
                "no copy: deleted"
            )
        if sel == 0:
            return (
                "write_through_selective: the shared prefix was inserted twice (A's request, "
                "then B's), and A's tail too once A came back: both are hot, and backed up"
            )
        return "write_through_selective: which nodes did two requests insert?"
    if wb == 0:
        return (
            "write_back copies a node when the device evicts it: evict(6) takes B's leaf, and "
            "its path must be backed up first (a copy needs its prefix)"
        )
    return (
        "write_back: evict(6) takes the least recently used device leaf; its whole path, "
        "shared prefix included, is copied to the host before the demotion"
    )


Q2_SOLUTION = """\
from minirad.kvcache.hiradix_cache import HiRadixCache
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator

A = list(range(1, 13))
B = A[:6] + list(range(20, 30))
answer = {}
for policy in ("write_through", "write_through_selective", "write_back"):
    alloc = TokenToKVPoolAllocator(64)
    cache = HiRadixCache(token_to_kv_pool_allocator=alloc, write_policy=policy)
    for key in (A, B):
        value = alloc.alloc(len(key))
        alloc.free(value[: cache.insert(key, value)])
    value = alloc.alloc(len(A))  # A again: a second request over A's path
    alloc.free(value[: cache.insert(A, value)])
    cache.evict(6)
    answer[policy] = cache.host_size()
# {'write_through': 22, 'write_through_selective': 12, 'write_back': 16}. write_through copies
# everything at insert: 6 shared + 6 of A + 10 of B. selective counts inserts (SGLang's
# hit_count): B's insert makes the shared 6 hot, A's second insert A's tail (12 in all); B's
# leaf, inserted once, has no copy and evict(6) deletes it. write_back copies only at
# eviction: B's leaf (the least recently used) with its prefix, 6 + 10."""

q2 = Exercise(
    "q2 three write policies",
    _check_q2,
    "write_through copies at every insert; write_through_selective once two requests have "
    "inserted a node (matches do not count); write_back when the device evicts a node. A copy "
    "always includes the node's prefix. Which leaf does evict(6) take after A comes back?",
    Q2_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q3
Q3_MODEL = {"num_layers": 16, "num_kv_heads": 8, "head_dim": 64, "dtype_bytes": 2}
Q3_LINK = TierLink("nvme-gen4", 7.0, 100.0)
Q3_PREFILL = 100_000.0  # tokens per second


def _q3(bytes_per_token: int | None = None, link: TierLink = Q3_LINK) -> int:
    """The shortest whole prefix that loads back strictly faster than it is recomputed."""
    bpt = kv_bytes_per_token(**Q3_MODEL) if bytes_per_token is None else bytes_per_token
    even = break_even_tokens(bpt, link, Q3_PREFILL)
    assert even is not None
    return math.floor(even) + 1


def _check_q3(answer: object) -> str | None:
    if not is_int(answer):
        return wrong_type("one int (tokens)", answer)
    expected = _q3()
    bpt = kv_bytes_per_token(**Q3_MODEL)
    if answer == expected:
        return None
    if answer == _q3(bpt // 2):
        return "a token's KV is a key and a value in every layer: count both"
    if answer == _q3(bpt * 2):
        return "bf16 is 2 bytes; a token's KV is 2 (K and V) x layers x KV heads x head size x 2"
    if answer == _q3(bpt // Q3_MODEL["num_layers"]):
        return "every layer keeps its own K and V: multiply by the 16 layers"
    if answer in (0, 1):
        return (
            "a load-back pays a fixed 100 microseconds before its first byte; a short prefix "
            "is cheaper to recompute"
        )
    if answer == expected - 1:
        return (
            "at that length loading is still not faster; the answer is the first whole "
            "token count past the break-even length"
        )
    return (
        "write both costs for n tokens: 100 us + n x bytes per token / 7e9 against "
        "n / 100,000 s; find where they cross"
    )


Q3_SOLUTION = """\
import math

from minirad.kvcache.transfer_cost import TierLink, break_even_tokens, kv_bytes_per_token

bpt = kv_bytes_per_token(num_layers=16, num_kv_heads=8, head_dim=64, dtype_bytes=2)
nvme = TierLink("nvme-gen4", bandwidth_gb_s=7.0, latency_us=100.0)
even = break_even_tokens(bpt, nvme, 100_000)
answer = math.floor(even) + 1
# 19: a token's KV is 32,768 bytes, 4.68 us over the NVMe against 10 us of prefill, so each
# token loaded saves 5.32 us, and 100 us of latency are repaid after 18.8 tokens. At 3 GB/s
# a token takes 10.9 us to load: break_even_tokens returns None, it never pays."""

q3 = Exercise(
    "q3 break-even length",
    _check_q3,
    "Bytes per token = 2 (K and V) x layers x KV heads x head size x bytes per value. Loading n "
    "tokens costs 100 us + n x bytes / (7 x 10**9 B/s); recomputing them n / 100,000 s.",
    Q3_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q4
Q4_S = list(range(1, 9))
Q4_M = list(range(10, 16))
Q4_T = list(range(20, 26))
Q4_OTHER = Q4_S + list(range(30, 36))
Q4_PAGE = 4
Q4_KEYS = ("device", "host", "storage")


@functools.cache
def _q4(evict_host: int = 6) -> tuple[int, int, int]:
    cache, alloc = _cache(
        hicache_ratio=1, storage=HiCacheMemoryStorage(), storage_page_size=Q4_PAGE
    )
    for key in (Q4_S + Q4_M, Q4_S + Q4_M + Q4_T, Q4_OTHER):
        _put(cache, alloc, key)
    cache.match_prefix(Q4_OTHER)
    cache.evict(12)
    cache.evict_host(evict_host)
    m = cache.match_prefix(Q4_S + Q4_M + Q4_T + [99])
    return len(m.indices), m.host_hit_length, m.storage_hit_length


def _check_q4(answer: object) -> str | None:
    got = _int_dict(answer, Q4_KEYS, "{'device': 0, 'host': 0, 'storage': 0}")
    device, host, storage = (got[k] for k in Q4_KEYS)
    e_device, e_host, e_storage = _q4()
    if (device, host, storage) == (e_device, e_host, e_storage):
        return None
    if device != e_device:
        return (
            "device: evict(12) demotes the least recently used device leaf, then its parent "
            "once it has become a device leaf itself; the last match kept the other branch fresh"
        )
    if host == len(Q4_M) + len(Q4_T):
        return "host: evict_host(6) deletes the host-only leaf T; only M is left on the host"
    if host != e_host:
        return "host: after the evictions, which node on the query's path is host-only?"
    if storage == len(Q4_S) + len(Q4_M) + len(Q4_T):
        return (
            "storage: storage_hit_length counts only the tokens past the tree's match, which "
            "already covers S and M"
        )
    if storage == 8:
        return (
            "storage: pages are 4 tokens, and the tree's match ends at token 14, inside page 3; "
            "the hit counts from token 14 to the end of the last stored page"
        )
    return (
        "storage: every path is written to storage in whole pages when it is backed up; which "
        "pages of the 20 tokens exist, and where does the tree's match end?"
    )


Q4_SOLUTION = """\
from minirad.kvcache.hicache_storage import HiCacheMemoryStorage
from minirad.kvcache.hiradix_cache import HiRadixCache
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator

S, M, T = list(range(1, 9)), list(range(10, 16)), list(range(20, 26))
other = S + list(range(30, 36))
alloc = TokenToKVPoolAllocator(64)
cache = HiRadixCache(
    token_to_kv_pool_allocator=alloc,
    hicache_ratio=1,
    storage=HiCacheMemoryStorage(),
    storage_page_size=4,
)
for key in (S + M, S + M + T, other):
    value = alloc.alloc(len(key))
    alloc.free(value[: cache.insert(key, value)])
cache.match_prefix(other)
cache.evict(12)
cache.evict_host(6)
m = cache.match_prefix(S + M + T + [99])
answer = {"device": len(m.indices), "host": m.host_hit_length, "storage": m.storage_hit_length}
# {'device': 8, 'host': 6, 'storage': 6}. The tree is S -> M -> T and S -> other. evict(12)
# demotes T (the oldest device leaf), then M (now a device leaf, older than the other branch,
# which the match refreshed). evict_host(6) deletes T, the only host-only leaf. Storage holds
# the 5 whole pages of S + M + T (tokens 0-19); the tree's match ends at 14, inside page 3, so
# the disk adds tokens 14 to 19."""

q4 = Exercise(
    "q4 three sources",
    _check_q4,
    "Draw S -> M -> T and S -> other. evict demotes device leaves (a parent whose children are "
    "all host-only is one), evict_host deletes host-only leaves. storage_hit_length counts the "
    "tokens past the tree's match up to the end of the last stored 4-token page.",
    Q4_SOLUTION,
)
