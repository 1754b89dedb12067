"""Image-aware cache keys (``minirad.kvcache.multimodal``) in both caches.

Two prompts with the same text and different images have identical token ids (the image is a
run of placeholder tokens), yet different KV from the first image token on. SGLang gives each
image's placeholders a pad id derived from the image hash (``mm_utils.pad_input_ids``); vLLM puts
``(mm_hash, offset)`` into the extra keys of every block that overlaps the image
(``kv_cache_utils._gen_mm_extra_hash_keys``). Either way the text before the image is shared
and nothing from the image on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from minirad import (
    ImageError,
    KVCacheManager,
    MultiModalItem,
    RadixCache,
    hash_image,
    pad_input_ids,
    pad_value,
)
from minirad.kvcache.multimodal import block_extra_keys, placeholder_runs

VOCAB = 100
IMG = 99  # the image placeholder token id


def image(color: tuple[int, int, int], size: tuple[int, int] = (4, 4)) -> Image.Image:
    return Image.new("RGB", size, color)


# ---------------------------------------------------------------------- hashing
def test_hash_image_depends_on_pixels_and_preprocessing_not_on_the_file(tmp_path: Path) -> None:
    red = image((255, 0, 0))
    for name in ("a.png", "b.png"):
        red.save(tmp_path / name)
    from_a, from_b = (Image.open(tmp_path / n) for n in ("a.png", "b.png"))
    assert hash_image(from_a) == hash_image(from_b) == hash_image(red)
    assert hash_image(red) != hash_image(image((255, 0, 1)))
    assert hash_image(red) != hash_image(image((255, 0, 0), (4, 5)))
    assert hash_image(red) != hash_image(red.convert("RGBA"))
    assert hash_image(red, size=32) != hash_image(red, size=64) != hash_image(red)


def test_hash_image_rejects_non_images_and_truncated_files(tmp_path: Path) -> None:
    with pytest.raises(ImageError):
        hash_image(b"not an image")
    path = tmp_path / "big.png"
    Image.effect_noise((64, 64), 50).save(path)
    data = path.read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError):
        hash_image(Image.open(tmp_path / "cut.png"))


def test_pad_ids_are_outside_the_vocabulary_and_replace_each_run() -> None:
    ha, hb = hash_image(image((1, 2, 3))), hash_image(image((4, 5, 6)))
    pa, pb = pad_value(ha, VOCAB), pad_value(hb, VOCAB)
    assert pa >= VOCAB and pb >= VOCAB and pa != pb
    prompt = [1, IMG, IMG, 2, IMG, 3]
    assert placeholder_runs(prompt, IMG) == [(1, 2), (4, 1)]
    assert pad_input_ids(prompt, IMG, [ha, hb], VOCAB) == [1, pa, pa, 2, pb, 3]
    with pytest.raises(ImageError):
        pad_input_ids(prompt, IMG, [ha], VOCAB)
    assert placeholder_runs([IMG, IMG], IMG) == [(0, 2)]


def test_pad_id_keeps_the_whole_hash() -> None:
    """Hashes that agree in every bit but the last get different pad ids (issue 11 point 2:
    a 30-bit pad id let two images share KV); a pad id gives its hash back."""
    h = hash_image(image((1, 2, 3)))
    twin = h[:-1] + format(int(h[-1], 16) ^ 1, "x")
    assert pad_value(h, VOCAB) != pad_value(twin, VOCAB)
    assert f"{pad_value(h, VOCAB) - VOCAB:064x}" == h
    with pytest.raises(ImageError):
        pad_value("not-a-hash", VOCAB)


# ---------------------------------------------------------------------- radix tree
TEXT, TAIL = [5, 6, 7], [8, 9]
PROMPT = TEXT + [IMG] * 4 + TAIL


def padded(img: Image.Image) -> list[int]:
    return pad_input_ids(PROMPT, IMG, [hash_image(img)], VOCAB)


def test_radix_forks_exactly_at_the_first_image_token() -> None:
    cache = RadixCache()
    ids_a, ids_b = padded(image((255, 0, 0))), padded(image((0, 0, 255)))
    assert ids_a[: len(TEXT)] == ids_b[: len(TEXT)] and ids_a != ids_b
    cache.insert(ids_a, list(range(len(ids_a))))
    assert cache.match_prefix(ids_b).indices == list(range(len(TEXT)))
    assert cache.insert(ids_b, list(range(100, 100 + len(ids_b)))) == len(TEXT)
    (fork,) = cache.root_node.children.values()
    assert fork.key == TEXT
    assert sorted(c.key[0] for c in fork.children.values()) == sorted({ids_a[3], ids_b[3]})
    # The same picture, as a new object, shares everything.
    assert cache.match_prefix(padded(image((255, 0, 0)))).indices == list(range(len(ids_a)))
    cache.check_invariants()


def test_radix_shares_up_to_the_first_differing_image() -> None:
    cat, dog, owl = (hash_image(image(c)) for c in ((1, 1, 1), (2, 2, 2), (3, 3, 3)))
    prompt = [1, 2] + [IMG] * 3 + [3] + [IMG] * 3 + [4]
    cache = RadixCache(page_size=2)
    cache.insert(pad_input_ids(prompt, IMG, [cat, dog], VOCAB), list(range(len(prompt))))
    # The second image starts at token 6: with pages of 2, tokens 0..5 are shared.
    assert len(cache.match_prefix(pad_input_ids(prompt, IMG, [cat, owl], VOCAB)).indices) == 6
    # A different first image (token 2) shares only the first page.
    assert len(cache.match_prefix(pad_input_ids(prompt, IMG, [owl, dog], VOCAB)).indices) == 2
    cache.check_invariants()


# ---------------------------------------------------------------------- block cache
BLOCK = 4
BLOCK_PROMPT = [1, 2, 3, 4, 5, 6] + [IMG] * 8 + [7, 8, 9]  # the image covers tokens 6..13


def test_block_extra_keys_name_every_block_that_overlaps_the_image() -> None:
    item = MultiModalItem(offset=6, length=8, mm_hash="h")
    keys = [block_extra_keys(s, s + BLOCK, [item]) for s in range(0, 20, BLOCK)]
    assert keys == [None, (("h", 2),), (("h", -2),), (("h", -6),), None]
    assert block_extra_keys(0, 4, [item], extra_key="salt") == ("salt",)
    assert block_extra_keys(4, 8, [item], extra_key="salt") == (("h", 2),)


def test_a_salted_first_block_with_an_image_keys_the_image_first_as_vllm_does() -> None:
    """vLLM 0.32 orders a block's extra keys LoRA name, images, cache salt
    (``generate_block_hash_extra_keys``); tests/test_vllm_events.py checks the real server's
    events against this."""
    item = MultiModalItem(offset=1, length=8, mm_hash="h")
    assert block_extra_keys(0, 4, [item], extra_key="salt") == (("h", 1), "salt")
    assert block_extra_keys(4, 8, [item], extra_key="salt") == (("h", -3),)


def test_block_cache_shares_only_the_blocks_before_the_image() -> None:
    ha, hb = hash_image(image((255, 0, 0))), hash_image(image((0, 0, 255)))
    item_a, item_b = MultiModalItem(6, 8, ha), MultiModalItem(6, 8, hb)
    mgr = KVCacheManager(32, BLOCK)
    hits, n = mgr.get_computed_blocks(BLOCK_PROMPT, [item_a])
    assert mgr.allocate_slots("a", BLOCK_PROMPT, len(BLOCK_PROMPT) - n, hits, [item_a])
    hashes_a = mgr.block_hashes(BLOCK_PROMPT, [item_a])
    hashes_b = mgr.block_hashes(BLOCK_PROMPT, [item_b])
    # Block 0 (tokens 0..3) is text only; block 1 holds the first image token (6).
    assert hashes_a[0] == hashes_b[0]
    assert all(x != y for x, y in zip(hashes_a[1:], hashes_b[1:], strict=True))
    hits, n = mgr.get_computed_blocks(BLOCK_PROMPT, [item_b])
    assert n == BLOCK and hits == mgr.req_to_blocks["a"][:1]
    assert mgr.allocate_slots("b", BLOCK_PROMPT, len(BLOCK_PROMPT) - n, hits, [item_b])
    # The same image in a third request: every block the len - 1 rule allows.
    same = MultiModalItem(6, 8, hash_image(image((255, 0, 0))))
    hits, n = mgr.get_computed_blocks(BLOCK_PROMPT, [same])
    assert n == (len(BLOCK_PROMPT) - 1) // BLOCK * BLOCK == 16
    assert hits == mgr.req_to_blocks["a"][:4]
    mgr.block_pool.check_invariants()


def test_block_cache_with_an_image_starting_on_a_block_boundary() -> None:
    prompt = list(range(1, 9)) + [IMG] * 4 + [9]
    mgr = KVCacheManager(16, BLOCK)
    a = [MultiModalItem(8, 4, "image-a")]
    mgr.allocate_slots("a", prompt, len(prompt), (), a)
    assert mgr.get_computed_blocks(prompt, [MultiModalItem(8, 4, "image-b")])[1] == 8
    assert mgr.get_computed_blocks(prompt, a)[1] == 12
    assert mgr.get_computed_blocks(prompt)[1] == 8  # no image info: text blocks only
