"""Chapter 11 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

``minirad.exercises.ch11`` computes its answers with a real ``HiRadixCache`` (and the cost
model of ``minirad.kvcache.transfer_cost``). The oracles use no minirad class: they apply the
tiers' rules by hand to plain lists (a prefix shared by two keys, the least recently used leaf,
the path a backup copies, whole storage pages), and q3 compares the two costs token by token
until loading back wins.
"""

from __future__ import annotations

from exercise_contract import ExerciseContract, common_len

from minirad.exercises import ch11

POLICIES = ("write_through", "write_through_selective", "write_back")


def oracle_q1() -> tuple[int, int]:
    """B splits A after their common prefix; A was matched last, so B's tail is the least
    recently used device leaf, and write-through gave it a host copy: evict(4) demotes it
    (whole: it holds 6 tokens, enough). The query then walks the prefix on the device and B's
    tail on the host; its own extra tokens were never cached."""
    common = common_len(ch11.Q1_A, ch11.Q1_B)
    assert len(ch11.Q1_B) - common >= 4
    return common, len(ch11.Q1_B) - common


def oracle_q2() -> dict[str, int]:
    """Host tokens after the history, policy by policy."""
    a, b = ch11.Q2_A, ch11.Q2_B
    common = common_len(a, b)
    return {
        # every insert copies its path: the distinct tokens of A and B
        "write_through": len(a) + len(b) - common,
        # B's insert makes the shared prefix hot (its second insert), A's second insert A's
        # tail: both copied; B's leaf, inserted once, is the least recently used leaf when
        # evict(6) runs, and goes without a copy
        "write_through_selective": len(a),
        # nothing is copied until evict(6) takes B's leaf (A came back after B's insert);
        # its copy includes the shared prefix
        "write_back": len(b),
    }


def load_s(n: int, bytes_per_token: int, gb_s: float, latency_us: float) -> float:
    return latency_us * 1e-6 + n * bytes_per_token / (gb_s * 1e9)


def oracle_q3(gb_s: float = 7.0, layers: int = 16) -> int:
    """The first whole token count at which loading back is strictly faster."""
    bytes_per_token = 2 * layers * 8 * 64 * 2  # K and V, layers, heads, head size, bf16
    n = 1
    while load_s(n, bytes_per_token, gb_s, 100.0) >= n / 100_000:
        n += 1
        assert n < 10**6, "never pays"
    return n


def oracle_q4() -> dict[str, int]:
    """The tree S -> M -> T, S -> other. evict(12) demotes T (the oldest device leaf), then
    M (a device leaf once T is host-only, older than the refreshed other branch). evict_host(6)
    deletes T, the host-only leaf. Storage keeps every whole 4-token page of S + M + T; the
    tree's match covers S and M."""
    s, m, t, page = ch11.Q4_S, ch11.Q4_M, ch11.Q4_T, ch11.Q4_PAGE
    stored = len(s + m + t) // page * page
    return {"device": len(s), "host": len(m), "storage": stored - len(s) - len(m)}


CASES = [
    (ch11.q1, oracle_q1, ch11.Q1_SOLUTION),
    (ch11.q2, oracle_q2, ch11.Q2_SOLUTION),
    (ch11.q3, oracle_q3, ch11.Q3_SOLUTION),
    (ch11.q4, oracle_q4, ch11.Q4_SOLUTION),
]


def _with(answer: dict[str, int], key: str, value: int) -> dict[str, int]:
    return {**answer, key: value}


def diagnosed() -> list:
    device, host = oracle_q1()
    q2, q4 = oracle_q2(), oracle_q4()
    s, m, t = len(ch11.Q4_S), len(ch11.Q4_M), len(ch11.Q4_T)
    right3 = oracle_q3()
    return [
        (ch11.q1, (device, 0), "RadixCache's answer"),
        (ch11.q1, (device + host, 0), "most recently used"),
        (ch11.q1, (host + 1, device - 1), "not that"),
        (ch11.q1, (device, host + 2), "never inserted"),
        (ch11.q1, [device], "expected 2 ints"),
        (ch11.q1, "6, 6", "expected 2 ints (len(indices), host_hit_length), got str"),
        (ch11.q2, _with(q2, "write_through", q2["write_through"] - 10), "distinct tokens"),
        (ch11.q2, _with(q2, "write_through_selective", q2["write_through"]), "inserted once"),
        (ch11.q2, _with(q2, "write_through_selective", 0), "inserted twice"),
        (ch11.q2, _with(q2, "write_back", 0), "a copy needs its prefix"),
        (ch11.q2, _with(q2, "write_back", 10), "shared prefix included"),
        (ch11.q2, [22, 12, 16], "expected a dict with the keys"),
        (ch11.q2, _with(q2, "write_back", 16.0), "an int for 'write_back'"),
        (ch11.q3, oracle_q3(layers=8), "count both"),
        (ch11.q3, oracle_q3(layers=1), "16 layers"),
        (ch11.q3, 1, "fixed 100 microseconds"),
        (ch11.q3, 0, "fixed 100 microseconds"),
        (ch11.q3, right3 - 1, "still not faster"),
        (ch11.q3, 1000, "where they cross"),
        (ch11.q3, 19.0, "expected one int (tokens), got float"),
        (ch11.q4, _with(q4, "device", s + m), "device:"),
        (ch11.q4, _with(q4, "host", m + t), "only M is left"),
        (ch11.q4, _with(q4, "host", 0), "host-only"),
        (ch11.q4, _with(q4, "storage", s + m + t), "past the tree's match"),
        (ch11.q4, _with(q4, "storage", 8), "inside page 3"),
        (ch11.q4, _with(q4, "storage", 0), "whole pages"),
        (ch11.q4, {"device": s, "host": m}, "expected a dict with the keys"),
    ]


class TestExerciseContract(ExerciseContract):
    chapter = ch11
    cases = CASES
    diagnosed = diagnosed


def test_the_tiers_matter_in_every_exercise():
    """Each answer differs from what a cache without that tier would give: q1's host part, q2's
    three policies, q3's latency (a link without it pays from the first token), q4's three
    sources."""
    assert oracle_q1()[1] > 0
    assert len(set(oracle_q2().values())) == 3
    assert oracle_q3() > 1
    assert all(oracle_q4().values())


def test_a_pcie3_nvme_never_pays_in_q3():
    """The follow-up the question suggests: at 3 GB/s a token's KV loads slower than it is
    computed."""
    bytes_per_token = 2 * 16 * 8 * 64 * 2
    assert bytes_per_token / 3e9 > 1 / 100_000
