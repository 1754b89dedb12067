"""Our paged decoder against Hugging Face on tiny Gemma 3 and Gemma 4 text models (5
sliding-window layers of window 16, then 1 full-attention layer): logits within 1e-4 in fp32,
greedy tokens equal to ``generate()``, on prompts of 1, 2 and 10 windows, in one chunk or
several, alone or with other sequences in the step, continued over a second turn from the
cache.

Each test serves its sequences as an engine would (:class:`Server`), in one of three layouts:

- ``one``: every layer in one pool, one slot space (as the Llama path);
- ``pools``: the sliding layers in a pool of their own, a second slot space (SGLang's SWA
  pool), whose slots the server drops as soon as the window has passed them: it poisons them
  with NaN, points the sequence's row at a null block of NaN, and hands whole blocks back to
  the free list, where the next allocation takes them. Parity then proves that nothing outside
  the window is read, and that an engine may free it;
- ``groups``: both slot spaces in one pool of all layers (vLLM's KV-cache groups, each layer
  its own tensor, one block table per group), dropped and poisoned likewise.
"""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import (
    BOS_ID,
    GEMMA3_WINDOW,
    IMAGE_TOKEN_ID,
    VOCAB_SIZE,
    gemma3_text_config,
    gemma4_text_config,
    pixel_inputs,
    prompt_ids,
    text_config,
    tiny_gemma3,
    tiny_gemma4,
    tiny_llava_gemma3,
)
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from minirad.errors import InvalidArgumentError, UnsupportedModelError
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from minirad.kvcache.kv_pool import KVCache
from minirad.models import (
    ForwardBatch,
    PagedDecoder,
    PagedVLM,
    cascade_attention,
    kv_cache_dims,
    paged_attention,
)
from minirad.models.gemma3 import gemma_rms_norm
from minirad.models.gemma4 import gemma4_rms_norm
from minirad.models.text_config import check_text_config, layer_groups, layer_specs

W = GEMMA3_WINDOW
ATOL = 1e-4
LAYOUTS = ("one", "pools", "groups")
NUM_BLOCKS = 128
BUILDERS = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request):
    return BUILDERS[request.param]()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS_ID, *torch.randint(4, VOCAB_SIZE, (n - 1,), generator=g).tolist()]


class Space:
    """One KV group's slot space: a pool, which of its layers the group owns, and a shuffled
    free list of blocks. With ``null``, block 0 is a null block of NaN, never handed out."""

    def __init__(self, pool: KVCache, layers: list[int], blocks: range, seed: int, null: bool):
        self.pool, self.layers, self.bs = pool, layers, pool.block_size
        self.null = blocks[0] * self.bs if null else None
        self.free = list(blocks[1:] if null else blocks)
        g = torch.Generator().manual_seed(seed)
        self.free = [self.free[i] for i in torch.randperm(len(self.free), generator=g)]
        if null:
            self.poison(range(self.null, self.null + self.bs))

    def poison(self, slots) -> None:
        layers, at = torch.tensor(self.layers)[:, None], torch.tensor(list(slots))[None, :]
        for cache in (self.pool.k_cache, self.pool.v_cache):
            cache.view(cache.shape[0], -1, *cache.shape[3:])[layers, at] = float("nan")

    def grow(self, row: list[int], n: int) -> None:
        for pos in range(len(row), len(row) + n):
            row.append(self.free.pop() * self.bs if pos % self.bs == 0 else row[-1] + 1)

    def drop(self, row: list[int], upto: int) -> None:
        """The window has passed positions ``< upto``: poison their slots, point them at the
        null block, and free each block whose last position went."""
        for pos in range(upto):
            if row[pos] == self.null:
                continue
            self.poison([row[pos]])
            if pos % self.bs == self.bs - 1:
                self.free.append(row[pos] // self.bs)
            row[pos] = self.null


class Seq:
    """A sequence: its tokens so far and one slot row per KV group."""

    def __init__(self, ids: list[int], num_groups: int):
        self.ids = list(ids)
        self.rows: list[list[int]] = [[] for _ in range(num_groups)]
        self.cached = 0  # tokens whose K/V are in the cache


class Server:
    """Runs sequences through a PagedDecoder the way an engine would, in one of
    :data:`LAYOUTS` (see the module docstring). Each pool's shape comes from the layers'
    specs (:func:`layer_specs`): a Gemma 4 full layer may have a head size of its own."""

    def __init__(self, model, layout: str, block_size: int = 4, dtype=torch.float32):
        specs = layer_specs(model.config, block_size, dtype)
        self.groups = [0] * len(specs) if layout == "one" else layer_groups(specs)
        owned = [[i for i, g in enumerate(self.groups) if g == k] for k in range(2)]

        def pool(layers: list[int], num_blocks: int) -> KVCache:
            spec = specs[layers[0]]
            dims = dict(num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size)
            return KVCache(len(layers), num_blocks, block_size, **dims, dtype=dtype)

        if layout == "pools":
            pools = [pool(o, NUM_BLOCKS) for o in owned]
            self.spaces = [
                Space(p, list(range(p.num_layers)), range(NUM_BLOCKS), k, null=k == 1)
                for k, p in enumerate(pools)
            ]
        else:
            pools = [pool(list(range(len(specs))), 2 * NUM_BLOCKS)]
            halves = [range(NUM_BLOCKS), range(NUM_BLOCKS, 2 * NUM_BLOCKS)]
            every = list(range(len(specs)))
            self.spaces = [Space(pools[0], every, halves[0], 0, null=False)]
            if layout == "groups":
                self.spaces = [
                    Space(pools[0], owned[k], halves[k], k, null=k == 1) for k in range(2)
                ]
        self.decoder = PagedDecoder.for_causal_lm(
            model, pools, prepack=False, layer_groups=self.groups
        )
        self.windowed = [k for k in range(len(self.spaces)) if k == 1]

    def new(self, ids: list[int]) -> Seq:
        return Seq(ids, len(self.spaces))

    def step(self, work: list[tuple[Seq, int]], all_logits: bool = False) -> torch.Tensor:
        """Run ``n`` more tokens of each ``(seq, n)`` (its next uncached ones)."""
        tokens = []
        for seq, n in work:
            for k in self.windowed:  # what no query of this step or later can see
                self.spaces[k].drop(seq.rows[k], max(0, seq.cached - W + 1))
            for space, row in zip(self.spaces, seq.rows, strict=True):
                space.grow(row, n)
            tokens.append(seq.ids[seq.cached : seq.cached + n])
            seq.cached += n
        rows = [[list(seq.rows[k]) for seq, _ in work] for k in range(len(self.spaces))]
        batch = ForwardBatch.build(tokens, rows[0], extra_kv_slots=rows[1:], all_logits=all_logits)
        return self.decoder(batch)

    def generate(self, seqs: list[Seq], steps: int) -> list[torch.Tensor]:
        """Greedy: prefill what each sequence has uncached, then ``steps - 1`` decodes.
        Returns each sequence's logits, ``[uncached + steps - 1, V]``, every row."""
        out = [[] for _ in seqs]
        work = [(s, len(s.ids) - s.cached) for s in seqs]
        for _ in range(steps):
            logits = self.step(work, all_logits=True)
            start = 0
            for i, (seq, n) in enumerate(work):
                rows = logits[start : start + n]
                start += n
                out[i].append(rows)
                seq.ids.append(int(rows[-1].argmax()))
            work = [(s, 1) for s in seqs]
        return [torch.cat(o) for o in out]


@torch.no_grad()
def hf_cached_logits(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """HF's logits for ``ids`` fed in ``chunks`` (lengths) over HF's own cache, as
    ``generate()`` feeds a prompt and then one token at a time."""
    logits, cache, start = [], None, 0
    for n in chunks:
        chunk = torch.tensor([ids[start : start + n]])
        out = model(input_ids=chunk, cache=cache, use_cache=True)
        logits.append(out.logits[0])
        cache, start = out.cache, start + n
    assert start == len(ids)
    return torch.cat(logits)


@torch.no_grad()
def hf_generate(model, ids: list[int], steps: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    return out[0, len(ids) :].tolist()


def close(a, b, atol=ATOL):
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def check_against_hf(model, seq: Seq, logits: torch.Tensor, chunks: list[int], steps: int):
    """The last ``steps`` tokens of ``seq.ids`` we generated greedily, feeding all but the
    last token in ``chunks``; ``logits`` are ours for the last positions fed. They are HF's
    logits for the same chunks over its cache, and HF's generate() tokens."""
    fed = seq.ids[:-1]
    close(logits, hf_cached_logits(model, fed, chunks)[len(fed) - len(logits) :])
    assert seq.ids[-steps:] == hf_generate(model, seq.ids[:-steps], steps)
    assert len(set(seq.ids[-steps:])) > 2  # not a degenerate repeat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norms_are_hfs_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 3, 64, generator=g) * 4).to(dtype)
    norm3, norm4, bare4 = Gemma3RMSNorm(64), Gemma4RMSNorm(64), Gemma4RMSNorm(64, with_scale=False)
    with torch.no_grad():
        norm3.weight.normal_(generator=g)
        norm4.weight.normal_(generator=g)
    norm3, norm4 = norm3.to(dtype), norm4.to(dtype)
    assert torch.equal(gemma_rms_norm(x, norm3), norm3(x))
    assert torch.equal(gemma4_rms_norm(x, norm4), norm4(x))
    assert torch.equal(gemma4_rms_norm(x, bare4), bare4(x))
    # Llama's cast-then-scale rounds differently in bf16: the order is part of the norm.
    llama_order = F.rms_norm(x.float(), (64,), eps=1e-6).to(dtype) * (1 + norm3.weight)
    assert dtype == torch.float32 or not torch.equal(llama_order, norm3(x))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("windows", [1, 2, 10])
def test_prompt_and_greedy_decode_match_hf(model, layout, windows):
    server = Server(model, layout)
    seq = server.new(prompt(windows * W, seed=windows))
    (logits,) = server.generate([seq], steps=10)
    assert logits.std() > 1.0  # the perturbed weights give logits worth comparing
    check_against_hf(model, seq, logits, [windows * W] + [1] * 9, 10)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_bf16_greedy_tokens_match_hf(family):
    """In bf16 the tokens are HF's, and the logits HF's as ``generate()`` computes them: its
    prompt pass, then one token at a time over its cache. The bound is one bf16 step at the
    largest logits (below the softcap of 30: 2**-3); measured, ours equal HF's bit for bit,
    as the same kernels see the same shapes. (HF's one pass over the whole sequence differs
    from its own cached decode by up to 0.33 here: bf16 rounds differently at other shapes.)"""
    model = BUILDERS[family](dtype=torch.bfloat16)
    for windows in (1, 2, 10):
        server = Server(model, "pools", dtype=torch.bfloat16)
        seq = server.new(prompt(windows * W, seed=windows))
        (logits,) = server.generate([seq], steps=10)
        assert logits.dtype == torch.bfloat16
        assert seq.ids[-10:] == hf_generate(model, seq.ids[:-10], 10)
        hf = hf_cached_logits(model, seq.ids[:-1], [windows * W] + [1] * 9)
        close(logits.float(), hf.float(), atol=2**-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_across_the_window(model, layout):
    """Chunks of 10, 17 and 23 tokens: the second and third cross window boundaries, and in
    the poisoned layouts the third starts after the first chunk's slots were dropped."""
    server = Server(model, layout)
    seq = server.new(prompt(50, seed=11))
    logits = torch.cat([server.step([(seq, n)], all_logits=True) for n in (10, 17, 23)])
    close(logits, hf_cached_logits(model, seq.ids, [10, 17, 23]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_second_turn_continues_from_the_cache(model, layout):
    """Turn 1: a 20-token prompt and 8 generated tokens. Turn 2 appends 30 user tokens and
    prefills only them (and the last generated token, not yet cached), over the first turn's
    slots, the windowed ones dropped by now; then 8 more tokens. The logits are HF's, fed the
    same chunks over its cache; the tokens are HF's generate() on the whole conversation.
    (HF's one pass over the conversation and its cached chunks differ by 1.1e-4 here, in
    fp32: the reference must compute what we compute.)"""
    server = Server(model, layout)
    seq = server.new(prompt(20, seed=12))
    server.generate([seq], steps=8)
    cached, rows = seq.cached, [list(r) for r in seq.rows]
    seq.ids += prompt(31, seed=13)[1:]  # the user's next message
    (logits,) = server.generate([seq], steps=8)
    assert seq.rows[0][:cached] == rows[0]  # the first turn's slots, reused
    for k in server.windowed:  # ... or dropped, behind the window
        null = server.spaces[k].null
        assert all(s in (old, null) for s, old in zip(seq.rows[k][:cached], rows[k], strict=True))
        assert seq.rows[k][0] == server.spaces[k].null
    check_against_hf(model, seq, logits, [20] + [1] * 7 + [31] + [1] * 7, 8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_several_sequences_per_step(model, layout):
    """A (3 windows) and B (7 tokens) prefill together, decode together, and C (25 tokens)
    joins in the fourth step: prefill and decodes in one forward pass."""
    server = Server(model, layout)
    a, b, c = (server.new(prompt(n, seed=20 + n)) for n in (48, 7, 25))
    ours = {id(s): [] for s in (a, b, c)}
    work = [(a, len(a.ids)), (b, len(b.ids))]
    for i in range(10):
        if i == 3:
            work.append((c, len(c.ids)))
        logits = server.step(work)
        for (seq, _), row in zip(work, logits, strict=True):
            ours[id(seq)].append(row)
            seq.ids.append(int(row.argmax()))
        work = [(s, 1) for s, _ in work]
    for seq, steps in ((a, 10), (b, 10), (c, 7)):
        n = len(seq.ids) - steps
        rows = hf_cached_logits(model, seq.ids[:-1], [n] + [1] * (steps - 1))
        close(torch.stack(ours[id(seq)]), rows[n - 1 :])
        assert seq.ids[-steps:] == hf_generate(model, seq.ids[:-steps], steps)


def test_decodes_sharing_a_prefix(model, monkeypatch):
    """Four decodes share a 40-token prefix (the same slots, as the radix tree shares them):
    the full-attention layer attends to it once (cascade), the windowed layers each read
    their own window; the logits are HF's."""
    monkeypatch.setattr(cascade_attention, "MIN_SAVED_BYTES", 1)  # a tiny model's prefix
    cascades = []

    def spy(q, *args):
        cascades.append(q.shape[0])
        return cascade_attention.cascade_decode(q, *args)

    monkeypatch.setattr(paged_attention, "cascade_decode", spy)
    server = Server(model, "one")
    shared = prompt(40, seed=30)
    first = server.new(shared)
    server.step([(first, 40)])
    seqs = []
    for i in range(4):
        seq = server.new(shared + prompt(3 + 2 * i, seed=31 + i)[1:])
        seq.rows[0], seq.cached = list(first.rows[0]), 40
        server.step([(seq, len(seq.ids) - 40)])
        seqs.append(seq)
    for seq in seqs:
        seq.ids.append(7)
    cascades.clear()
    logits = server.step([(s, 1) for s in seqs])
    assert server.decoder.layer_kinds == [(0, W)] * 5 + [(0, None)]
    assert cascades == [4]  # the full-attention layer only, all four decodes at once
    for seq, row in zip(seqs, logits, strict=True):
        close(row, hf_cached_logits(model, seq.ids, [40, len(seq.ids) - 41, 1])[-1])


def test_a_prompt_of_ten_windows_reads_one_window_per_decode(model):
    """A decode gathers W keys in a sliding layer, the whole sequence in the full one."""
    server = Server(model, "pools")
    seq = server.new(prompt(10 * W, seed=40))
    server.generate([seq], steps=2)
    live = [s for s in seq.rows[1] if s != server.spaces[1].null]
    assert len(live) <= W + server.spaces[1].bs  # the window, and the rest of its blocks
    assert len(seq.rows[0]) == 10 * W + 1


def test_a_gemma4_full_layer_with_a_head_size_of_its_own():
    """Gemma 4's global layers may have their own head size (``global_head_dim``): their K/V
    then live in a pool of their own shape, and the model runs as HF's."""
    model = tiny_gemma4(global_head_dim=64)
    with pytest.raises(UnsupportedModelError, match="one KV pool cannot hold them"):
        kv_cache_dims(model.config)
    specs = layer_specs(model.config, 4, torch.float32)
    assert [s.head_size for s in specs] == [32] * 5 + [64]
    server = Server(model, "pools")
    assert [p.head_dim for p in server.decoder.kv_caches] == [64, 32]
    seq = server.new(prompt(3 * W, seed=50))
    (logits,) = server.generate([seq], steps=10)
    check_against_hf(model, seq, logits, [3 * W] + [1] * 9, 10)


def test_a_llava_around_a_gemma3_text_model_is_hfs():
    """PagedVLM over a LLaVA whose text model is Gemma 3's: a prompt with an image, 2 windows
    long, and greedy decodes, as HF's LLaVA computes them: without the logit softcap its text
    config names (HF's LLaVA head does not apply it; PagedVLM's decoder takes none)."""
    model = tiny_llava_gemma3()
    assert model.config.text_config.final_logit_softcapping is not None
    pool = KVCache(num_blocks=64, block_size=4, **kv_cache_dims(model.config))
    vlm = PagedVLM(model, pool)
    ids = prompt_ids("llava-llama", text_before=9, text_after=6)  # 32 tokens, 16 of them image
    pixels = pixel_inputs("llava-llama")
    rows = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]
    feats = torch.cat(vlm.encode_images(pixels))
    slots = list(range(len(ids)))
    batch = ForwardBatch.build(
        [ids], [slots], mm_features=feats, mm_token_indices=rows, all_logits=True
    )
    logits = [vlm(batch)]
    tokens = [int(logits[0][-1].argmax())]
    for _ in range(7):
        slots.append(len(slots))
        logits.append(vlm(ForwardBatch.build([[tokens[-1]]], [slots])))
        tokens.append(int(logits[-1][-1].argmax()))
    with torch.no_grad():
        hf = model(input_ids=torch.tensor([ids + tokens[:-1]]), **pixels).logits[0]
        out = model.generate(
            input_ids=torch.tensor([ids]), **pixels, max_new_tokens=8, do_sample=False
        )
    close(torch.cat(logits), hf)
    assert tokens == out[0, len(ids) :].tolist()


def test_layer_specs_and_groups():
    cfg = gemma3_text_config()
    specs = layer_specs(cfg, block_size=4, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(4, 1, 32, torch.bfloat16, sliding_window=W)
    assert specs == [sliding] * 5 + [FullAttentionSpec(4, 1, 32, torch.bfloat16)]
    assert layer_groups(specs) == [1, 1, 1, 1, 1, 0]
    llama = layer_specs(text_config("llama"), 16, torch.float32)
    assert llama == [FullAttentionSpec(16, 2, 16, torch.float32)] * 2
    assert layer_groups(llama) == [0, 0]


def test_batches_and_pools_must_fit_the_groups(model):
    server = Server(model, "pools")
    batch = ForwardBatch.build([[1, 5, 6]], [[0, 1, 2]])  # no slots for group 1
    with pytest.raises(InvalidArgumentError, match="KV group 1"):
        server.decoder(batch)
    with pytest.raises(InvalidArgumentError, match="group 1"):
        ForwardBatch.build([[1, 5]], [[0, 1]], extra_kv_slots=[[[0, 1, 2]]])
    pools = server.decoder.kv_caches
    with pytest.raises(InvalidArgumentError, match="cannot hold"):
        PagedDecoder(model.model, model.lm_head, pools, layer_groups=[0] * 6)
    with pytest.raises(InvalidArgumentError, match="layer_groups"):
        PagedDecoder(model.model, model.lm_head, pools, layer_groups=[1, 0])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(attn_logit_softcapping=50.0), "attention logit softcapping"),
        (dict(use_bidirectional_attention=True), "bidirectional"),
        (
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                }
            ),
            "dynamic",
        ),
    ],
)
def test_unsupported_gemma_features_are_refused(overrides, match):
    with pytest.raises(UnsupportedModelError, match=match):
        check_text_config(gemma3_text_config(**overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(hidden_size_per_layer_input=8),
        dict(num_kv_shared_layers=2),
        dict(enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=8),
        dict(attention_k_eq_v=True),
        dict(use_bidirectional_attention="vision"),
    ],
)
def test_unsupported_gemma4_features_are_refused(overrides):
    with pytest.raises(UnsupportedModelError, match=next(iter(overrides))):
        check_text_config(gemma4_text_config(**overrides))
