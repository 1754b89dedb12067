"""Real-size models built offline (minirad.course.real_size): the real dimensions, the Hub's
weight names, and the engine's greedy tokens equal to HF ``generate()``'s on them. Two text
layers and one vision layer, at the real widths, keep the test short."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from test_device_dtype import BF16_TOL, assert_greedy_agrees, hf_greedy
from test_tiny_vlm import assert_hub_layout
from transformers import AutoModelForImageTextToText, AutoProcessor

from minirad.course.real_size import LIKE, main, make_model
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.models import DEFAULT_MODEL_DIR

IMAGE = DEFAULT_MODEL_DIR.parents[1] / "images" / "orange_square.png"


def test_llava_200m_has_the_real_dimensions_and_the_hub_layout(tmp_path):
    out = make_model("llava-200m", tmp_path / "m", text_layers=2, vision_layers=1)
    model = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    text, vision = model.config.text_config, model.config.vision_config
    sizes = LIKE["llava-200m"]
    assert (
        (text.hidden_size, text.intermediate_size)
        == (576, 1536)
        == (
            sizes["text_hidden"],
            sizes["text_mlp"],
        )
    )
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (9, 3, 64)
    assert (vision.hidden_size, vision.intermediate_size, vision.num_attention_heads) == (
        768,
        3072,
        12,
    )
    assert (text.num_hidden_layers, vision.num_hidden_layers) == (2, 1)
    assert model.config.image_seq_length == (224 // 16) ** 2 == 196
    assert_hub_layout(out / "model.safetensors")
    again = make_model("llava-200m", tmp_path / "again", text_layers=2, vision_layers=1)
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


@pytest.mark.parametrize("like", sorted(LIKE))
def test_the_engine_gives_hf_generates_tokens_and_logits_at_the_real_widths(tmp_path, like):
    """Random weights at HF's init give near-flat logits (greedy then repeats one token), so
    the logits are compared too, not only the tokens."""
    out = make_model(like, tmp_path / "m", text_layers=2, vision_layers=1)
    engine = LLMEngine.from_pretrained(out)
    processor = AutoProcessor.from_pretrained(out, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True).eval()
    messages = [{"role": "user", "content": "<image>\nWhat colour is the square?"}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_new_tokens=8)
    ours = engine.generate([GenerateRequest(prompt, [str(IMAGE)], params, return_logits=True)])
    image = Image.open(IMAGE).convert("RGB")
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    with torch.no_grad():
        hf = model.generate(
            **inputs,
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert len(ours[0].prompt_token_ids) == inputs["input_ids"].shape[1]  # image tokens in
    assert list(ours[0].token_ids) == hf.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    theirs = torch.stack(hf.logits)[:, 0]
    torch.testing.assert_close(ours[0].logits, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("like", sorted(LIKE))
def test_a_bf16_engine_agrees_with_hf_generate_at_the_real_widths(tmp_path, like):
    """The same models in bf16 (KV pool too), three requests in one batch, against HF
    ``generate()`` on the same bf16 model one request at a time: logits within
    :data:`~test_device_dtype.BF16_TOL` of the row's largest, and the same greedy tokens
    wherever HF's top-1 / top-2 margin is clearly above that (the first step of a random
    model is often a near-tie: margins of 0.05 on logits of ~2).

    Measured (CPU, torch 2.13, 2 text + 1 vision layers): our logits at most 1 ulp of the row's
    largest apart from HF's (0.008-0.012 on logits up to ~2.6, at most 2^-7.1 of the row's
    largest), every token equal; one request alone gives HF's logits bit for bit."""
    out = make_model(like, tmp_path / "m", text_layers=2, vision_layers=1)
    engine = LLMEngine.from_pretrained(out, dtype=torch.bfloat16)
    model, processor = engine.vlm.model, engine.processor
    assert model.dtype == torch.bfloat16 == engine.kv_cache.k_cache.dtype
    images = [IMAGE, *sorted(IMAGE.parent.glob("*circle*.png"))[:2]]
    questions = ["What colour is the square?", "Describe the image.", "How many shapes are there?"]
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": f"<image>\n{q}"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in questions
    ]
    params = SamplingParams(max_new_tokens=8)
    outs = engine.generate(
        [
            GenerateRequest(p, [str(im)], params, return_logits=True)
            for p, im in zip(prompts, images, strict=True)
        ]
    )
    refs = [hf_greedy(model, processor, p, im, 8) for p, im in zip(prompts, images, strict=True)]
    compared = sum(
        assert_greedy_agrees(o, *ref, BF16_TOL) for o, ref in zip(outs, refs, strict=True)
    )
    assert compared >= 0.9 * sum(len(tokens) for tokens, _ in refs)


def test_smolvlm_256m_has_the_real_dimensions(tmp_path):
    out = make_model("smolvlm-256m", tmp_path / "m", text_layers=2, vision_layers=1)
    model = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (576, 9, 3)
    assert (vision.hidden_size, vision.intermediate_size, vision.image_size) == (768, 3072, 512)
    processor = AutoProcessor.from_pretrained(out, local_files_only=True)
    assert processor.image_seq_len == (512 // 16) ** 2 // 4**2 == 64


def test_the_command_refuses_a_bad_size(capsys):
    with pytest.raises(SystemExit) as e:
        main(["/tmp/never", "--like", "gpt-5"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["/tmp/never", "--text-layers", "0"])
    assert "text_layers must be >= 1" in capsys.readouterr().err
