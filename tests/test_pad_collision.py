"""Issue 11 point 2: two different images must never share KV through the radix key.

An image enters the radix key as its pad id (:func:`minirad.kvcache.multimodal.pad_value`). When
that id kept 30 bits of the image hash (SGLang's ``hash % 2**30``), two of about 2**15 images shared
one, and the second was answered from the first one's KV. The pair below is two scenes of
:mod:`minirad.course.scenes` (by layout seed) whose hashes agree in those 30 bits: a search over the
first 50,000 seeds found it (``render(random_scene(Random(seed)))``, hashed with the shipped
model's image processor, a dict of pad ids). Stored as seeds, not image files.
"""

import random
from pathlib import Path

import pytest

from minirad.course.scenes import CAPTION_PROMPT, caption, random_scene, render
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.kvcache.multimodal import pad_value

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "models" / "minirad-tiny-llava"
SEED_A, SEED_B = 24373, 49760  # "a yellow square" / three shapes, top to bottom
OLD_PAD_BITS = 30

pytestmark = pytest.mark.skipif(not SHIPPED.is_dir(), reason="the shipped tiny LLaVA is missing")


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(SHIPPED)


def scene_image(seed):
    scene = random_scene(random.Random(seed))
    return caption(scene), render(scene)


def describe(engine, image):
    text = engine.processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": CAPTION_PROMPT}],
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    return GenerateRequest(text, [image], SamplingParams(max_new_tokens=24))


def test_the_pair_collides_in_30_bits_only(engine):
    """The regression pair is a real collision of the old id, and the new ids differ."""
    proc = engine.input_processor
    (cap_a, img_a), (cap_b, img_b) = scene_image(SEED_A), scene_image(SEED_B)
    item_a, item_b = (proc.process("<image>", [im]).images[0] for im in (img_a, img_b))
    assert cap_a != cap_b and item_a.mm_hash != item_b.mm_hash
    old = [int(it.mm_hash[:16], 16) % 2**OLD_PAD_BITS for it in (item_a, item_b)]
    assert old[0] == old[1]
    assert item_a.pad_value != item_b.pad_value
    assert item_a.pad_value == pad_value(item_a.mm_hash, proc.vocab_size)


def test_second_image_is_answered_from_its_own_kv(engine):
    """Serve A, then B: B's answer and cached tokens are what B gets alone. With 30-bit pad
    ids B got A's caption with 76 of its 77 prompt tokens cached."""
    (_, img_a), (cap_b, img_b) = scene_image(SEED_A), scene_image(SEED_B)
    engine.reset_prefix_cache()
    alone = engine.generate([describe(engine, img_b)])[0]
    engine.reset_prefix_cache()
    first = engine.generate([describe(engine, img_a)])[0]
    after_a = engine.generate([describe(engine, img_b)])[0]
    assert alone.text == cap_b  # the shipped model captions this scene right
    assert first.text != cap_b
    assert after_a.token_ids == alone.token_ids
    # Only the chat markup before the image is shared with A.
    image_start = after_a.prompt_token_ids.index(engine.vlm.image_token_id)
    assert after_a.stats.cached_tokens == image_start
