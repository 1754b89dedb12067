"""The hybrid tiny VLM (data/models/minirad-tiny-gemma3-llava/): a LLaVA whose text model is Gemma
3's decoder, five sliding-window layers then one full. Training applies the window (the packed
batch equals HF's own unpacked forward), the folder loads offline with the stock HF classes and
answers fresh scenes, and the real vLLM serves it with the same greedy tokens as HF."""

import json
import random
import re
from functools import cache

import pytest
import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Gemma3TextConfig,
    LlavaForConditionalGeneration,
)

from minirad.course.scenes import TASK_TYPES, ask, random_scene, render
from minirad.course.train import (
    EVAL_SEED,
    MAX_ANSWER_TOKENS,
    PackedBatcher,
    TrainConfig,
    answer_logits,
    build_model,
    build_processor,
    evaluate,
    make_examples,
    sliding_window_of,
    text_config,
)
from minirad.models import DEFAULT_MODEL_DIR
from minirad.models.tokenizer import IM_END, load_tokenizer

MODEL_DIR = DEFAULT_MODEL_DIR.parent / "minirad-tiny-gemma3-llava"
TEST_SEED = 20_261_130  # neither the training stream (seed 0 + ...) nor the model card's EVAL_SEED
MAX_BYTES = 10 * 2**20


@cache
def shipped():
    model = AutoModelForImageTextToText.from_pretrained(MODEL_DIR, local_files_only=True)
    processor = AutoProcessor.from_pretrained(MODEL_DIR, local_files_only=True)
    return model.eval(), processor


def tiny_gemma3(window: int = 8) -> tuple[TrainConfig, LlavaForConditionalGeneration]:
    """A small random gemma3-family model: one sliding layer, then one full."""
    cfg = TrainConfig(
        vision_hidden=32,
        vision_mlp=64,
        text_hidden=32,
        text_mlp=64,
        text_layers=2,
        text_family="gemma3",
        sliding_window=window,
        sliding_window_pattern=2,
    )
    torch.manual_seed(0)
    model = build_model(load_tokenizer(), cfg).eval()
    with torch.no_grad():  # random init gives near-flat logits; spread them out
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return cfg, model


def one_prompt_at_a_time(model, processor, examples):
    """Each answer's logits and targets from the plain one-question prompt, as generate() sees
    it: HF builds its own masks, the sliding one included, from the 2-D attention mask."""
    tokenizer = processor.tokenizer
    logits, targets = [], []
    for image, asked, system in examples:
        for q in asked:
            content = [{"type": "image"}, {"type": "text", "text": q.prompt}]
            turns = [{"role": "system", "content": system}] if system else []
            prompt = processor.apply_chat_template(
                [*turns, {"role": "user", "content": content}],
                add_generation_prompt=True,
                tokenize=False,
            )
            inputs = processor(images=image, text=prompt + q.answer + IM_END, return_tensors="pt")
            ids = inputs["input_ids"][0]
            n_answer = len(tokenizer.encode(q.answer + IM_END))
            logits.append(model(**inputs).logits[0, len(ids) - n_answer - 1 : -1])
            targets.append(ids[len(ids) - n_answer :])
    return torch.cat(logits), torch.cat(targets)


def test_gemma3_text_config():
    cfg = TrainConfig(text_family="gemma3", text_layers=6)
    config = text_config(load_tokenizer(), cfg)
    assert isinstance(config, Gemma3TextConfig)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config.sliding_window, config.head_dim, config.query_pre_attn_scalar) == (32, 32, 32)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings >= 1024
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (2, 0, None)
    theta = {k: v["rope_theta"] for k, v in config.rope_parameters.items()}
    assert theta == {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    with pytest.raises(ValueError, match="no full-attention layer"):
        text_config(load_tokenizer(), TrainConfig(text_family="gemma3", text_layers=3))
    with pytest.raises(ValueError, match="unknown text family"):
        text_config(load_tokenizer(), TrainConfig(text_family="mamba"))
    assert sliding_window_of(build_model(load_tokenizer(), TrainConfig()).config) is None


def test_packed_batch_applies_the_sliding_window():
    """Training packs an image's questions into one row (shared image prefix, custom mask,
    position ids that restart per question). With a window of 8, far shorter than a prompt,
    each answer's logits must equal HF's own unpacked forward of the one-question prompt. The
    packed mask without the window (a plain 4-D mask, which every layer then uses as it is)
    must not."""
    cfg, model = tiny_gemma3(window=8)
    processor = build_processor(load_tokenizer(), cfg.image_size, cfg.patch_size)
    assert sliding_window_of(model.config) == 8
    rng = random.Random(1)
    examples = make_examples(rng, 2) + make_examples(rng, 2, system_prob=1.0)
    batch = PackedBatcher(processor, sliding_window_of(model.config))(examples)
    assert set(batch["attention_mask"]) == {"full_attention", "sliding_attention"}
    with torch.no_grad():
        packed, targets = answer_logits(model, batch)
        expected, expected_targets = one_prompt_at_a_time(model, processor, examples)
        unwindowed, _ = answer_logits(model, PackedBatcher(processor)(examples))
    assert torch.equal(targets, expected_targets)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5)
    assert (unwindowed - expected).abs().max() > 1e-2
    assert len(batch["input_ids"]) == len(examples)  # one row per image


def test_training_smoke_run(tmp_path):
    """A 2-step gemma3 run saves a LLaVA with a Gemma 3 text config that reloads with the
    stock Auto classes, and a model card that names the family, the window and the pattern."""
    from minirad.course.train import main

    threads = torch.get_num_threads()
    out = tmp_path / "g"
    argv = ["--out", str(out), "--steps", "2", "--eval-every", "2", "--eval-scenes", "2"]
    argv += ["--text-family", "gemma3", "--text-layers", "2", "--sliding-window-pattern", "2"]
    try:
        main([*argv, "--text-hidden", "32", "--text-mlp", "64"])
    finally:
        torch.set_num_threads(threads)  # train() fixes its own thread count
    model = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    assert model.config.text_config.model_type == "gemma3_text"
    assert model.config.text_config.layer_types == ["sliding_attention", "full_attention"]
    card = (out / "README.md").read_text()
    assert "Gemma 3" in card and "window 32" in card and "1 sliding : 1 full" in card


def test_the_llama_card_renders_as_committed():
    """The template now serves both families; rendered from the Llama model's own numbers
    (read back from its card), it gives the committed card, byte for byte."""
    from minirad.course.train import TrainRun, model_card

    card = (DEFAULT_MODEL_DIR / "README.md").read_text()
    row = r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$"
    curve = [(int(m[1]), *map(float, m.groups()[1:])) for m in re.finditer(row, card, re.MULTILINE)]
    accuracy = re.findall(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+) \|$", card, re.MULTILINE)
    run = TrainRun(
        command="python -m minirad.course.train --out data/models/minirad-tiny-llava",
        seconds=float(re.search(r"Measured training time: \*\*(\d+) s", card)[1]),
        eval_seconds=float(re.search(r"match; ([\d.]+) s for both", card)[1]),
        accuracy={task: float(a) for task, a, _ in accuracy},
        with_system={task: float(a) for task, _, a in accuracy},
        curve=curve,
        software=re.search(r"other jobs \((.*?)\), including", card, re.DOTALL)[1],
    )
    assert len(curve) == 20 and len(accuracy) == 9
    model = AutoModelForImageTextToText.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    out = DEFAULT_MODEL_DIR.relative_to(DEFAULT_MODEL_DIR.parents[2])  # data/models/...
    assert str(model_card(TrainConfig(out=out), model, run)) == card


# ------------------------------------------------------------------------ the shipped folder
def test_folder_is_a_standard_hf_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "chat_template.jinja",
        "README.md",
    ):
        assert required in names
    assert not any(n.endswith((".bin", ".pt", ".pkl", ".py")) for n in names)
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) < MAX_BYTES
    model, processor = shipped()
    assert isinstance(model, LlavaForConditionalGeneration)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    text = config["text_config"]
    assert text["model_type"] == "gemma3_text"
    assert text["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert text["sliding_window"] == 32
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert "auto_map" not in config  # loads without trust_remote_code
    # The same tokenizer, template and image processor as the Llama model.
    llama = AutoProcessor.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    assert processor.tokenizer.get_vocab() == llama.tokenizer.get_vocab()
    assert processor.chat_template == llama.chat_template
    assert model.generation_config.eos_token_id == 2


def test_prompts_exceed_the_window_several_times():
    """The point of the model: a one-question prompt is two to three windows long."""
    _, processor = shipped()
    scene = random_scene(random.Random(TEST_SEED))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    n = processor(images=render(scene), text=text, return_tensors="pt")["input_ids"].shape[1]
    assert n >= 2 * 32


def test_accuracy_on_fresh_scenes():
    """The committed model learned every task, far above chance (a colour or shape is one of
    six). It is weaker than the Llama model (its card lists the tasks under 0.95: 2,400 steps
    at one thread on a busy machine, against the Llama model's 4,000): on these 150 scenes
    captions 0.73, JSON 0.67, the questions 0.89 together."""
    model, processor = shipped()
    accuracy = evaluate(model, processor, n_scenes=150, seed=TEST_SEED)
    for task in TASK_TYPES:
        assert accuracy[task] >= 0.6, (task, accuracy)
    assert accuracy["all"] >= 0.8, accuracy


def test_model_card_reports_the_measured_numbers():
    card = (MODEL_DIR / "README.md").read_text()
    model, _ = shipped()
    assert f"{sum(p.numel() for p in model.parameters()):,}" in card
    assert f"{(MODEL_DIR / 'model.safetensors').stat().st_size:,} bytes" in card
    assert "python -m minirad.course.train --out data/models/minirad-tiny-gemma3-llava" in card
    assert "--text-family gemma3" in card
    assert f"seed {EVAL_SEED}" in card
    assert "5 sliding : 1 full" in card and "window 32" in card


# ------------------------------------------------------------------------ the real vLLM
def hf_answer(model, processor, image, question: str) -> tuple[list[int], list[int]]:
    """HF generate()'s greedy output ids (the stop token included) for the chat prompt, and
    the prompt's ids."""
    content = [{"type": "image"}, {"type": "text", "text": question}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(images=image, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist(), inputs["input_ids"][0].tolist()


def stored_groups(socket) -> dict[int, tuple[str, int | None]]:
    """``{group_idx: (kind, sliding window)}`` of the BlockStored events waiting on a SUB
    socket (vLLM's wire: frames topic, seq, msgpack ``[ts, events, dp_rank]``)."""
    import msgspec
    import zmq

    groups = {}
    while socket.poll(2000, zmq.POLLIN):
        payload = socket.recv_multipart()[-1]
        for event in msgspec.msgpack.decode(payload)[1]:
            if isinstance(event, dict) and event.get("type") == "BlockStored":
                kind = event.get("kv_cache_spec_kind")
                groups[event["group_idx"]] = (kind, event.get("kv_cache_spec_sliding_window"))
    return groups


def test_real_vllm_serves_it_with_hf_tokens(vllm_python):
    """vLLM 0.32 loads the folder as committed, with its hybrid KV-cache manager on (its
    default), and answers five image questions with HF generate()'s greedy tokens. Its KV
    events show the groups it made: one per layer here (a group holds as many layers as the
    rarer type has: 1), the full layer's and five sliding-window ones of window 32."""
    import zmq

    from minirad.peers.vllm_server import VLLMServer

    model, processor = shipped()
    rng = random.Random(TEST_SEED + 3)
    asks = []
    for task in ("caption", "json", "colour", "where", "count"):
        scene = random_scene(
            rng, objects=[("red", "circle"), ("blue", "square"), ("green", "triangle")]
        )
        asks.append((render(scene), ask(scene, task, rng)))
    context = zmq.Context.instance()
    with VLLMServer(MODEL_DIR, python=vllm_python, max_num_seqs=4).start() as server:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(server.kv_events_endpoint)
        try:
            for image, question in asks:
                theirs = server.chat(question.prompt, image=image, max_tokens=MAX_ANSWER_TOKENS)
                mine, prompt_ids = hf_answer(model, processor, image, question.prompt)
                assert theirs["prompt_token_ids"] == prompt_ids
                assert theirs["token_ids"] == mine, (question, theirs["text"])
                assert theirs["text"] == question.answer
            groups = stored_groups(socket)
        finally:
            socket.close(linger=0)
        log = server.log_path.read_text()
    print(f"vLLM's KV-cache groups (index: kind, window): {groups}")
    assert "kv cache group sizes (32, 32, 32, 32, 32, 32)" in log
    assert (
        sorted(groups.values(), key=str)
        == [("full_attention", None)] + [("sliding_window", 32)] * 5
    ), groups
