"""SGLang's cached tokens, request by request, from our radix tree.

The pure tests pin each rule of :mod:`minirad.kvcache.cached_tokens` on small hand-made
requests. The others run the text chat workload on the real SGLang 0.5.23 (``make sglang``; three
server starts, about 30 s each: page size 1 with and without the overlap scheduler, page size
16) with a pool small enough to evict, and check that our replay gives every request the
``cached_tokens`` SGLang reported, and SGLang's greedy answers are our engine's. Skipped
without the venv, except under CI=true.
"""

from __future__ import annotations

import pytest

from minirad.bench import build_parser
from minirad.bench.sglang_cache import (
    Run,
    belady_per_request,
    engine_answers,
    format_comparison,
    format_policies,
    run_sglang,
)
from minirad.bench.text_chat import Answer, chat_turns, run_turns
from minirad.errors import InvalidArgumentError, OutOfMemoryError
from minirad.kvcache.cached_tokens import ServedRequest, kv_len, replay_cached_tokens

POOL = 192  # tokens: the workload's unbounded cache would hold about 2000
TURNS = chat_turns()


def served(prompt, output, max_new_tokens=None, stopped=False):
    return ServedRequest(prompt, output, max_new_tokens or len(output), stopped)


P = list(range(100, 120))  # a 20-token prompt
OUT = [7, 8, 9, 10]


# ---------------------------------------------------------------------- the rules, pure
@pytest.mark.parametrize(
    ("output_len", "max_new", "stopped", "overlap", "expected"),
    [
        (4, 4, False, True, 23),  # a length finish: output[:-1]
        (4, 8, True, True, 24),  # a stop before max_new_tokens, overlap: the stop token too
        (4, 4, True, True, 23),  # a stop as the last allowed token: not fed, not cached
        (4, 8, True, False, 23),  # no overlap scheduler: output[:-1] always
        (1, 1, False, True, 20),  # one token: only the prompt has KV
    ],
)
def test_insert_rule(output_len, max_new, stopped, overlap, expected):
    assert kv_len(20, output_len, max_new, stopped, overlap) == expected


def test_at_most_all_but_the_last_prompt_token_matches():
    assert replay_cached_tokens([served(P, OUT), served(P, OUT)], 256) == [0, 19]


@pytest.mark.parametrize(
    ("max_new", "stopped", "overlap", "next_cached"),
    [(4, False, True, 23), (8, True, True, 24), (4, True, True, 23), (8, True, False, 23)],
)
def test_next_turn_finds_the_tokens_the_rule_cached(max_new, stopped, overlap, next_cached):
    first = served(P, OUT, max_new, stopped)
    turn2 = served(P + OUT + [1, 2, 3], [5, 6])
    assert replay_cached_tokens([first, turn2], 256, overlap=overlap) == [0, next_cached]


def test_only_whole_pages_match():
    # 23 tokens cached -> 20 in whole pages of 4; the next prompt shares 24 but finds 20.
    assert replay_cached_tokens([served(P, OUT), served(P + OUT + [1], [5])], 64, 4)[1] == 20


def test_eviction_drops_an_answer_and_keeps_its_prompt():
    # A caches 20 prompt + 9 answer tokens; B needs 16 with 11 free: evicting A's answer (the
    # least recent leaf, cut from its prompt) is enough, so C still finds A's prompt.
    a = served(P, list(range(10)))
    b = served(list(range(500, 515)), [1, 2])
    c = served(P + [3, 4], [5, 6])
    assert replay_cached_tokens([a, b, c], 40) == [0, 0, 20]


def test_pages_are_evicted_for_a_spare_page():
    # Pages of 4, a pool of 4 pages. A caches 2 pages; B computes 5 tokens (2 pages) with 2
    # pages free, but SGLang asks for one more, spare: A's answer page goes.
    a = served(list(range(100, 106)), [1, 2, 3])  # KV: [100..103] [104, 105, 1, 2]
    b = served(list(range(500, 505)), [9])
    c = served(list(range(100, 106)) + [1, 2, 3], [4])
    assert replay_cached_tokens([a, b, c], 16, 4) == [0, 0, 4]


def test_priority_evicts_answers_before_prompts():
    a = served(P, list(range(10)))
    b = served(list(range(200, 220)), list(range(10)))
    c = served(list(range(300, 310)), [1, 2])
    d = served(list(range(400, 409)), [1, 2])
    e = served(P + [5], [6])
    lru = replay_cached_tokens([a, b, c, d, e], 60)
    prio = replay_cached_tokens([a, b, c, d, e], 60, eviction_policy="priority")
    assert lru[-1] == 0 and prio[-1] == 20  # LRU took A's old prompt, priority B's answer


def test_priority_raises_only_a_prompt_that_its_answer_adds_a_page_to():
    # Pages of 4. A's answer adds a page past its 8-token prompt: prompt at priority 1. B's
    # single token does not: B's prompt stays at 0, and goes before A's older one.
    a = served(list(range(100, 108)), [1, 2, 3, 4, 5])
    b = served(list(range(200, 209)), [9])
    c = served(list(range(300, 307)), [9])
    d = served(list(range(100, 108)) + [50], [9])
    assert replay_cached_tokens([a, b, c, d], 24, 4, "priority")[-1] == 8
    assert replay_cached_tokens([a, b, c, d], 24, 4, "lru")[-1] == 0


def test_a_request_larger_than_the_pool_is_refused():
    with pytest.raises(OutOfMemoryError):
        replay_cached_tokens([served(list(range(50)), [1, 2])], 32)


# ---------------------------------------------------------------------- the workload, pure
def test_workload_is_deterministic_with_shared_prompts_and_branches():
    assert chat_turns() == TURNS and chat_turns(seed=1) != TURNS
    opened = [t for t in TURNS if t.after is None]
    assert len(opened) == 10 and len({t.system for t in opened}) > 1
    assert sum(t.system == 0 for t in opened) >= 2  # a system prompt shared by conversations
    continued = [t.after for t in TURNS if t.after is not None]
    assert len(continued) > len(set(continued))  # some turn has two follow-ups: a branch
    assert all(t.after is None or t.after < i for i, t in enumerate(TURNS))
    with pytest.raises(InvalidArgumentError, match="num_conversations"):
        chat_turns(0)


def test_a_continued_prompt_extends_the_prompt_and_its_answer():
    outputs = iter([([5, 6, 2], True), ([5, 6], False)] * len(TURNS))
    answers = run_turns(TURNS, lambda prompt, n: (*next(outputs), None))
    for a in answers:
        if a.after is None:
            continue
        prev = answers[a.after]
        assert a.prompt[: len(prev.prompt) + len(prev.output)] == prev.prompt + prev.output
        close = a.prompt[len(prev.prompt) + len(prev.output)]
        assert (close == 2) != prev.stopped  # <|im_end|> closes an answer cut by length
    assert all(len(a.prompt) + 24 < 512 for a in answers)  # the model's context


def test_belady_is_per_request_and_bounds_the_replay():
    answers = run_turns(TURNS, lambda prompt, n: ([5, 6, 2][: min(n, 3)], n >= 3, None))
    run = Run(POOL, 1, True, "lru", answers)
    best = belady_per_request(run)
    assert len(best) == len(answers) and sum(best) >= sum(run.ours())


def test_tables_and_command():
    answers = [
        Answer("c0t0", None, P, OUT, 4, False, 0),
        Answer("c0t1", 0, P + OUT + [1], [5, 2], 8, True, 23),
    ]
    runs = {"lru": Run(64, 1, True, "lru", answers), "fifo": Run(64, 1, True, "fifo", answers)}
    table = format_comparison(runs["lru"], [OUT, [5, 2]])
    assert "same cached tokens: 2/2 requests" in table
    assert "same greedy tokens as our engine: 2/2" in table
    policies = format_policies(runs, [0, 23])
    assert "lru 2/2, fifo 2/2" in policies
    args = build_parser("sglang-cache").parse_args(["sglang-cache", "--page-size", "16"])
    assert args.page_size == 16 and args.max_total_tokens == POOL and not args.policies


# ---------------------------------------------------------------------- the real SGLang
def assert_same_cached_tokens(run: Run) -> None:
    sglang = [a.cached_tokens for a in run.answers]
    assert run.ours() == sglang, format_comparison(run)
    assert sum(run.ours(max_total_tokens=1 << 16)) > sum(sglang)  # the pool did evict


@pytest.fixture(scope="module")
def page1(sglang_python):
    return run_sglang(TURNS, max_total_tokens=POOL, python=sglang_python)


@pytest.fixture(scope="module")
def page1_no_overlap(sglang_python):
    return run_sglang(TURNS, max_total_tokens=POOL, overlap=False, python=sglang_python)


def test_same_cached_tokens_page_1_with_evictions(page1):
    assert_same_cached_tokens(page1)


def test_same_cached_tokens_page_16_with_evictions(sglang_python):
    run = run_sglang(TURNS, max_total_tokens=POOL, page_size=16, python=sglang_python)
    assert_same_cached_tokens(run)
    assert all(a.cached_tokens % 16 == 0 for a in run.answers)


def finish_kind(a: Answer) -> str:
    if not a.stopped:
        return "length"
    return "last" if len(a.output) == a.max_new_tokens else "early"


def test_the_overlap_scheduler_caches_a_stop_token(page1, page1_no_overlap):
    assert_same_cached_tokens(page1_no_overlap)
    for run, other in ((page1, page1_no_overlap), (page1_no_overlap, page1)):
        assert [a.output for a in run.answers] == [a.output for a in other.answers]
        wrong = replay_cached_tokens(run.served(), POOL, overlap=not run.overlap)
        assert wrong != [a.cached_tokens for a in run.answers]  # the rule matters here
    # The workload continues answers of all three kinds: cut by length, stopped early (the
    # overlap scheduler fed the stop token), stopped as the last allowed token (it did not).
    kinds: dict[str, list[int]] = {}
    for i, a in enumerate(page1.answers):
        if a.after is not None:
            kinds.setdefault(finish_kind(page1.answers[a.after]), []).append(i)
    assert sorted(kinds) == ["early", "last", "length"]
    # After an early stop, the next turn finds one token more with the overlap scheduler
    # (where nothing was evicted in between).
    assert any(
        page1.answers[i].cached_tokens == page1_no_overlap.answers[i].cached_tokens + 1
        for i in kinds["early"]
    )


def test_greedy_tokens_equal_our_engine(page1):
    assert engine_answers(page1.answers) == [a.output for a in page1.answers]


@pytest.mark.parametrize(
    "request_",
    [
        ([1, 2, 3], [4], 8),  # three fields
        {"prompt": [1, 2], "output": [3], "max_new_tokens": 4, "stopped": True},
        None,
        ([], [4], 8, False),  # an empty prompt (SGLang answers 400)
        ([1, 2], [], 8, False),  # no output: not a finished request
        ([1, 2], [3, 4, 5], 2, False),  # more output than max_new_tokens
        ([1, -2], [3], 8, False),
        ([1, 2], [3], 8, "yes"),
    ],
)
def test_replay_refuses_what_no_finished_request_is(request_):
    with pytest.raises(InvalidArgumentError):
        replay_cached_tokens([request_], max_total_tokens=64)


@pytest.mark.parametrize("args", [(-5, -3, 8, False), (0, 1, 8, False), (10.5, 2, 8, False)])
def test_kv_len_refuses_impossible_lengths(args):
    with pytest.raises(InvalidArgumentError):
        kv_len(*args)


def test_a_pool_too_small_for_the_workload_is_refused_before_a_server_starts():
    from minirad.bench.sglang_cache import MIN_POOL, run_cli

    args = build_parser("sglang-cache").parse_args(
        ["sglang-cache", "--max-total-tokens", str(MIN_POOL - 1)]
    )
    with pytest.raises(InvalidArgumentError, match="too small"):
        run_cli(args)
