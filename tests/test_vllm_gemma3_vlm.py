"""What the real vLLM 0.32 on a CPU does with Gemma 3's image tokens (``make vllm``; skipped
without it, except in CI).

HF's ``Gemma3ForConditionalGeneration`` lets an image's tokens attend to each other, later
ones included (``token_type_ids``); vLLM marks Gemma 3 a "prefix LM" (``is_mm_prefix_lm``:
no prefill chunk cut inside an image) but only some GPU attention backends apply the
bidirectional mask, and the CPU backend is not one of them. Measured here: a tiny random
``Gemma3ForConditionalGeneration`` (tests/tiny_models.py :func:`tiny_gemma3_vlm` with its
processor, saved offline) answers three image prompts (16, 48 and 86 tokens after vLLM's
expansion; 1, 2 and 3 images; the longer ones past the 16-token window) greedily in vLLM
(``tests/vllm_gemma3_vlm_trace.py``, about 50 s on 2 cores). vLLM's tokens and
log-probabilities are those of the *causal* variant (our ``PagedVLM(...,
bidirectional_images=False)``, i.e. HF without ``token_type_ids``), within 1e-3, and not HF's
model: its log-probabilities miss HF's by more than 0.5 on every prompt, and its greedy tokens
differ from ``generate(..., token_type_ids=...)`` on at least one (2 of 3 when measured).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tiny_models import (
    BOI_ID,
    BOS_ID,
    IMAGE_TOKEN_ID,
    VOCAB_SIZE,
    tiny_gemma3_processor,
    tiny_gemma3_vlm,
)

from minirad.kvcache.kv_pool import KVCache
from minirad.models import ForwardBatch, PagedVLM, image_features_for_chunk, kv_cache_dims

SCRIPT = Path(__file__).with_name("vllm_gemma3_vlm_trace.py")
STEPS = 8


def save_for_vllm(model, out: Path) -> Path:
    """The model and its processor, as vLLM 0.32 loads them: transformers 5.25 writes the
    SigLIP tower's weights as ``vision_tower.embeddings...``; vLLM wants the older
    ``vision_tower.vision_model.embeddings...``, so the file is rewritten with those names."""
    model.save_pretrained(out)
    tiny_gemma3_processor().save_pretrained(out)
    path = out / "model.safetensors"
    tower, old = "vision_tower.", "vision_tower.vision_model."
    weights = {
        (old + k[len(tower) :] if k.startswith(tower) and not k.startswith(old) else k): v
        for k, v in load_file(path).items()
    }
    save_file(weights, path, metadata={"format": "pt"})
    return out


def trace(tmp: Path) -> dict:
    """Three prompts with one ``<start_of_image>`` per image (vLLM expands each) and random
    32x32 PNG images."""
    rng = np.random.RandomState(0)
    paths = []
    for i in range(3):
        paths.append(str(tmp / f"image{i}.png"))
        Image.fromarray(rng.randint(0, 255, (32, 32, 3), dtype=np.uint8)).save(paths[-1])
    g = torch.Generator().manual_seed(0)

    def text(n: int) -> list[int]:
        return torch.randint(10, VOCAB_SIZE, (n,), generator=g).tolist()

    def prompt(before: int, *afters: int) -> list[int]:
        ids = [BOS_ID, *text(before)]
        for n in afters:
            ids += [BOI_ID, *text(n)]
        return ids

    return {
        "prompts": [
            {"ids": prompt(3, 4), "images": paths[:1]},
            {"ids": prompt(20, 2, 9), "images": paths[1:]},
            {"ids": prompt(30, 12, 5, 14), "images": paths},
        ],
        "max_tokens": STEPS,
    }


def chosen_logprobs(logits: torch.Tensor, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probability of each token after the first of ``ids + tokens``, from the logits of
    ``ids + tokens[:-1]``: what vLLM reports as ``prompt_logprobs[1:] + logprobs``."""
    targets = torch.tensor(ids[1:] + tokens)
    return logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]


@torch.no_grad()
def paged(model, ids: list[int], pixels: torch.Tensor, tokens: list[int], bidirectional: bool):
    """Our PagedVLM's logits of ``ids`` then ``tokens[:-1]`` (one prefill, then decodes of the
    given tokens: vLLM's), and its argmax after each (its greedy token at each step, given
    vLLM's tokens before it)."""
    pool = KVCache(num_blocks=64, block_size=4, **kv_cache_dims(model.config))
    vlm = PagedVLM(model, pool, bidirectional_images=bidirectional)
    feats = image_features_for_chunk(
        ids, 0, len(ids), IMAGE_TOKEN_ID, vlm.encode_images({"pixel_values": pixels})
    )
    rows = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]
    slots = list(range(len(ids)))
    batch = ForwardBatch.build(
        [ids], [slots], mm_features=feats, mm_token_indices=rows, all_logits=True
    )
    logits = [vlm(batch)]
    greedy = [int(logits[0][-1].argmax())]
    for t in tokens[:-1]:
        slots.append(len(slots))
        logits.append(vlm(ForwardBatch.build([[t]], [slots])))
        greedy.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), greedy


@torch.no_grad()
def hf_generate(model, ids: list[int], pixels: torch.Tensor) -> list[int]:
    types = torch.tensor([[int(t == IMAGE_TOKEN_ID) for t in ids]])
    out = model.generate(
        input_ids=torch.tensor([ids]),
        pixel_values=pixels,
        token_type_ids=types,
        max_new_tokens=STEPS,
        do_sample=False,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def vllm_run(vllm_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma3-vlm")
    model = tiny_gemma3_vlm()
    save_for_vllm(model, tmp / "model")
    work = trace(tmp)
    (tmp / "trace.json").write_text(json.dumps(work))
    run = subprocess.run(
        [vllm_python, SCRIPT, tmp / "model", tmp / "trace.json", tmp / "out.json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = json.loads((tmp / "out.json").read_text())
    print(f"vLLM: {out['seconds']:.1f} s, attention {out['backends']}", file=sys.stderr)
    return model, work, out["rows"]


def test_vllm_cpu_attends_causally_within_gemma3_images(vllm_run):
    model, work, rows = vllm_run
    processor = tiny_gemma3_processor()
    differ = []
    for prompt, row in zip(work["prompts"], rows, strict=True):
        ids, tokens = row["prompt_token_ids"], row["token_ids"]
        n = len(prompt["images"])
        assert ids.count(IMAGE_TOKEN_ID) == 4 * n  # vLLM expanded each <start_of_image>
        images = [Image.open(p).convert("RGB") for p in prompt["images"]]
        pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
        theirs = torch.tensor(row["prompt_logprobs"][1:] + row["logprobs"])

        causal, causal_tokens = paged(model, ids, pixels, tokens, bidirectional=False)
        bidi, _ = paged(model, ids, pixels, tokens, bidirectional=True)
        gap_causal = (chosen_logprobs(causal, ids, tokens) - theirs).abs().max().item()
        gap_hf = (chosen_logprobs(bidi, ids, tokens) - theirs).abs().max().item()
        hf_tokens = hf_generate(model, ids, pixels)
        print(
            f"{len(ids)} tokens: vLLM {tokens}, causal max |dlogprob| {gap_causal:.1e}, "
            f"HF's model {gap_hf:.2f}, HF generate {hf_tokens}",
            file=sys.stderr,
        )
        assert tokens == causal_tokens  # the causal variant's greedy choice at every step
        assert gap_causal < 1e-3
        assert gap_hf > 0.5
        with torch.no_grad():  # the bidirectional variant is HF's model
            types = torch.tensor([[int(t == IMAGE_TOKEN_ID) for t in ids + tokens[:-1]]])
            hf = model(
                input_ids=torch.tensor([ids + tokens[:-1]]),
                pixel_values=pixels,
                token_type_ids=types,
            ).logits[0]
        torch.testing.assert_close(bidi, hf, atol=1e-4, rtol=0)
        differ.append(tokens != hf_tokens)
    assert any(differ)
