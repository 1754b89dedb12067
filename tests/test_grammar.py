"""minirad.engine.grammar on its own: the bitmask, the compiler's cache, typed errors, jump-forward.

Every expectation is derived, never typed in: the masked logits from a per-token loop over the
bitmask's bits, the forced prefix from the schema's compact JSON (``json.dumps`` of the
documents it allows), the allowed tokens from the grammar's own bitmask. The tokenizer is the
course's (data/tokenizer/, the shipped model's), over the shipped model's 1024 logit columns.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minirad.course.scenes import COLOURS, SHAPES, SHAPES_JSON_SCHEMA
from minirad.engine.grammar import (
    GrammarCompiler,
    GrammarLogitsProcessor,
    allocate_token_bitmask,
    apply_token_bitmask,
)
from minirad.engine.sampling_params import SamplingParams
from minirad.errors import GrammarError, InvalidArgumentError

MODEL_DIR = Path(__file__).resolve().parents[1] / "data" / "models" / "minirad-tiny-llava"
VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["text_config"]["vocab_size"]
STOP = (2,)  # <|im_end|>, the course model's end of turn


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def allowed(grammar) -> set[int]:
    """The token ids ``grammar``'s bitmask allows now, read bit by bit."""
    mask = allocate_token_bitmask(1, VOCAB)
    grammar.fill_bitmask(mask, 0)
    return {t for t in range(VOCAB) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def loop_masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The reference: one Python test per (row, token). Python ints shift arithmetically, so a
    negative int32 word's bits read as two's complement, as the backends write them."""
    out = logits.clone()
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[b, t // 32]) >> (t % 32)) & 1:
                out[b, t] = float("-inf")
    return out


# ------------------------------------------------------------------ the bitmask
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "vocab", "extra_words"),
    [(1, 1, 0), (3, 31, 0), (2, 33, 0), (4, 100, 1), (2, 1024, 0)],
)
def test_apply_token_bitmask_equals_a_per_token_loop(dtype, batch, vocab, extra_words):
    g = torch.Generator().manual_seed(vocab * 7 + batch)
    words = (vocab + 31) // 32 + extra_words
    bitmask = torch.randint(-(2**31), 2**31, (batch, words), dtype=torch.int32, generator=g)
    bitmask[0, 0] = -1  # one all-allowed word and one all-forbidden word, besides random ones
    if words > 1:
        bitmask[-1, 1] = 0
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    expected = loop_masked(logits, bitmask)
    ptr = logits.data_ptr()
    assert apply_token_bitmask(logits, bitmask) is None
    assert logits.data_ptr() == ptr  # in place
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    # -inf exactly where a bit is clear: nowhere else, and the other values untouched.
    assert torch.equal(torch.isneginf(logits), torch.isneginf(expected))


def test_an_all_allowed_bitmask_changes_nothing():
    mask = allocate_token_bitmask(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32
    assert bool((mask == -1).all())
    logits = torch.randn(3, 70)
    before = logits.clone()
    apply_token_bitmask(logits, mask)
    assert torch.equal(logits, before)
    assert allocate_token_bitmask(2, 64).shape == (2, 2)
    assert allocate_token_bitmask(1, VOCAB).shape == (1, VOCAB // 32 + (VOCAB % 32 > 0))


@pytest.mark.parametrize(
    ("logits", "bitmask"),
    [
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64)),  # int64 words
        (torch.zeros(2, 64), torch.zeros(2, 2)),  # float words
        (torch.zeros(64), torch.zeros(1, 2, dtype=torch.int32)),  # 1-D logits
        (torch.zeros(2, 64), torch.zeros(2, 2, 1, dtype=torch.int32)),  # 3-D bitmask
        (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32)),  # rows differ
        (torch.zeros(2, 65), torch.zeros(2, 2, dtype=torch.int32)),  # too few words
    ],
)
def test_apply_token_bitmask_rejects_bad_shapes_and_dtypes(logits, bitmask):
    before = logits.clone()
    with pytest.raises(InvalidArgumentError, match="bitmask|int32"):
        apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, before)


# ------------------------------------------------------------------ the compiler's cache
def test_same_grammar_is_compiled_once_and_each_request_gets_its_own_copy(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB)
    params = SamplingParams(json_schema=SHAPES_JSON_SCHEMA)
    g1 = compiler.compile(params, STOP)
    g2 = compiler.compile(SamplingParams(json_schema=SHAPES_JSON_SCHEMA), STOP)
    assert (compiler.num_compiled, compiler.num_cache_hits) == (1, 1)
    start_mask, start_run = allowed(g2), g2.jump_forward_tokens()
    g1.accept_tokens(g1.jump_forward_tokens())
    assert g1.num_accepted == len(start_run) > 0
    # Advancing g1 moved neither g2 nor the cached template (a third copy).
    g3 = compiler.compile(params, STOP)
    for g in (g2, g3):
        assert g.num_accepted == 0
        assert allowed(g) == start_mask
        assert g.jump_forward_tokens() == start_run
    assert allowed(g1) != start_mask
    assert (compiler.num_compiled, compiler.num_cache_hits) == (1, 2)


def test_other_stop_tokens_are_another_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB)
    params = SamplingParams(choice=["red circle"])
    text_ids = tokenizer.encode("red circle")
    ends = {}
    for stop in (STOP, (0,), STOP):
        g = compiler.compile(params, stop)
        g.accept_tokens(text_ids)
        ends[stop] = allowed(g)
    assert (compiler.num_compiled, compiler.num_cache_hits) == (2, 1)
    # Once the text is complete, only that grammar's own end-of-sequence token may follow.
    assert ends == {STOP: set(STOP), (0,): {0}}
    other_kinds = [SamplingParams(regex="red circle"), SamplingParams(choice=["red", "circle"])]
    for p in other_kinds:
        compiler.compile(p, STOP)
    assert compiler.num_compiled == 4


# ------------------------------------------------------------------ typed errors
BAD_PARAMS = [  # (constraint, stage it fails at, words the message must contain)
    (dict(regex="a(b"), "compile", "unclosed group"),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "compile", "minimum"),
    (dict(json_schema={"type": "strin"}), "compile", "strin"),
    (dict(json_schema='{"type": "object",'), "params", "not valid JSON"),
    (dict(json_schema="[1, 2]"), "params", "JSON object"),
    (dict(json_schema=[{"type": "string"}]), "params", "JSON object"),
    (dict(choice=[]), "params", "non-empty"),
    (dict(choice=["red", ""]), "params", "non-empty"),
    (dict(choice="red"), "params", "list of strings, got str"),
    (dict(choice={"red", "blue"}), "params", "got set"),  # unordered: the key would vary
    (dict(choice={"red": 1}), "params", "got dict"),
    (dict(json_schema={"type": "number", "maximum": float("nan")}), "params", "serializable"),
    (dict(regex="[^\\x00-\\U0010FFFF]"), "compile", "allows no text"),
    (dict(regex=""), "params", "non-empty"),
    (dict(regex="red", choice=["red"]), "params", "at most one"),
    (dict(json_schema={"type": "string"}, regex="a"), "params", "at most one"),
]


@pytest.mark.parametrize(("kwargs", "stage", "words"), BAD_PARAMS)
def test_bad_constraints_raise_a_grammar_error_naming_the_problem(compiler, kwargs, stage, words):
    """Shape errors at ``SamplingParams(...)`` (no tokenizer needed: the CLI checks them before
    loading the engine); a grammar that does not parse or that nothing satisfies at compile
    (the engine's ``add_request``, see tests/test_structured_output.py)."""
    if stage == "params":
        with pytest.raises(GrammarError, match=words):
            SamplingParams(**kwargs)
        return
    params = SamplingParams(**kwargs)
    n = compiler.num_compiled
    with pytest.raises(GrammarError, match=words):
        compiler.compile(params, STOP)
    assert compiler.num_compiled == n  # nothing cached


def test_compile_without_a_constraint_is_an_invalid_argument(compiler):
    with pytest.raises(InvalidArgumentError):
        compiler.compile(SamplingParams(), STOP)


def test_a_token_the_grammar_forbids_raises(compiler):
    g = compiler.compile(SamplingParams(json_schema=SHAPES_JSON_SCHEMA), STOP)
    ok = allowed(g)
    forbidden = min(set(range(VOCAB)) - ok)
    with pytest.raises(GrammarError, match=f"token {forbidden} is not allowed by the json_schema"):
        g.accept_token(forbidden)
    assert g.num_accepted == 0


# ------------------------------------------------------------------ jump-forward and rollback
def forced_prefix_of_shapes_schema() -> str:
    """The text every document of SHAPES_JSON_SCHEMA starts with: the common prefix of the
    compact documents with one to three items of every colour and shape."""
    docs = [
        json.dumps({"shapes": [{"colour": c, "shape": s}] * n})
        for c in COLOURS
        for s in SHAPES
        for n in (1, 2, 3)
    ]
    return os.path.commonprefix(docs)


def test_the_shapes_schema_forces_its_prefix_and_each_forced_token_is_allowed(compiler, tokenizer):
    prefix = forced_prefix_of_shapes_schema()
    assert prefix.endswith('"colour": "')  # a free choice follows: the first colour
    g = compiler.compile(SamplingParams(json_schema=SHAPES_JSON_SCHEMA), STOP)
    run = g.jump_forward_tokens()
    assert tokenizer.decode(run) == prefix
    assert run == tokenizer.encode(prefix)  # the tokenizer's own split of the forced text
    for t in run:  # the mask at each point allows the token the run puts there
        assert t in allowed(g)
        g.accept_token(t)
    assert g.jump_forward_tokens() == []  # the run was maximal: a colour is free now
    starts = {tokenizer.decode([t])[:1] for t in allowed(g)}
    assert starts == {c[0] for c in COLOURS}


def test_rollback_restores_the_bitmask(compiler):
    g = compiler.compile(SamplingParams(json_schema=SHAPES_JSON_SCHEMA), STOP)
    masks, accepted = [allowed(g)], []
    for _ in range(25):  # the forced prefix, then always the smallest allowed id
        t = min(masks[-1])
        g.accept_token(t)
        accepted.append(t)
        masks.append(allowed(g))
    for k in (1, 7, 25):
        g.rollback(k)
        assert g.num_accepted == 25 - k
        assert allowed(g) == masks[25 - k]
        g.accept_tokens(accepted[25 - k :])
        assert allowed(g) == masks[25]
    with pytest.raises(GrammarError, match="cannot roll back 26 of 25"):
        g.rollback(26)


@pytest.mark.parametrize("choices", [["red"], ["red", "reddish"], ["red circle"]])
def test_rollback_of_the_stop_token_undoes_only_that_token(compiler, tokenizer, choices):
    """After "red" the grammar of ["red"] is already terminated (only the stop token may follow)
    and llguidance accepts the stop token without recording it; after "red" in ["red",
    "reddish"] it is not. Either way, rolling back one token undoes the stop token only."""
    g = compiler.compile(SamplingParams(choice=choices), STOP)
    text = tokenizer.encode(choices[0])
    g.accept_tokens(text)
    before = allowed(g)
    g.accept_token(STOP[0])
    assert g.stopped and g.is_terminated
    g.rollback(1)
    assert not g.stopped and g.num_accepted == len(text)
    assert allowed(g) == before and STOP[0] in before
    g.rollback(len(text))  # and back to the start
    assert allowed(g) == allowed(compiler.compile(SamplingParams(choice=choices), STOP))


# ------------------------------------------------------------------ property: choices
WORDS = ("red", "re", "d", "circle", "circ", "le", "blue", "a")


@given(
    choices=st.lists(
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(" ".join),
        min_size=1,
        max_size=4,
        unique=True,
    ),
    seed=st.integers(0, 2**31),
    jump=st.booleans(),
)
def test_greedy_decoding_through_the_mask_yields_exactly_one_choice(
    compiler, tokenizer, choices, seed, jump
):
    """Random logits, argmax of the masked row, optionally jump-forward between samples: the
    text always ends on the stop token and is one of the choices, whatever the splits."""
    g = compiler.compile(SamplingParams(choice=choices), STOP)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    mask = allocate_token_bitmask(1, VOCAB)
    for _ in range(4 * max(len(c) for c in choices) + 2):  # a char per token at worst
        if jump:
            run = g.jump_forward_tokens()
            g.accept_tokens(run)
            ids += run
        g.fill_bitmask(mask, 0)
        logits = torch.randn(1, VOCAB, generator=gen)
        apply_token_bitmask(logits, mask)
        t = int(logits.argmax())
        g.accept_token(t)
        ids.append(t)
        if g.stopped:
            break
    assert g.stopped and ids[-1] in STOP
    assert tokenizer.decode(ids[:-1]) in choices


def test_the_hf_logits_processor_masks_each_row_with_its_grammar(compiler, tokenizer):
    """Row 0 follows the JSON grammar, row 1 a choice; a row's grammar advances by the row's
    last token once the ids grow past the prompt; the scores are masked copies."""
    grammars = [
        compiler.compile(SamplingParams(json_schema=SHAPES_JSON_SCHEMA), STOP),
        compiler.compile(SamplingParams(choice=["red circle"]), STOP),
    ]
    references = [
        compiler.compile(SamplingParams(json_schema=SHAPES_JSON_SCHEMA), STOP),
        compiler.compile(SamplingParams(choice=["red circle"]), STOP),
    ]
    processor = GrammarLogitsProcessor(grammars, prompt_length=3)
    ids = torch.tensor([[1, 5, 6], [1, 5, 6]])
    for _ in range(2):
        scores = torch.randn(2, VOCAB)
        masked = processor(ids, scores)
        assert masked is not scores and not torch.isinf(scores).any()
        for row, ref in enumerate(references):
            finite = {int(t) for t in torch.nonzero(torch.isfinite(masked[row]))}
            assert finite == allowed(ref)
        nxt = [min(allowed(ref)) for ref in references]
        for ref, t in zip(references, nxt, strict=True):
            ref.accept_token(t)
        ids = torch.cat([ids, torch.tensor(nxt).unsqueeze(1)], dim=1)
    assert [g.num_accepted for g in grammars] == [1, 1]  # the last column is not consumed yet
    with pytest.raises(InvalidArgumentError, match="3 rows"):
        processor(torch.cat([ids, ids[:1]]), torch.randn(3, VOCAB))
