"""The shipped tiny VLM (data/models/minirad-tiny-llava/) loads offline with the stock HF classes
and answers fresh scenes correctly; the training script runs end to end."""

import json
import random
import shutil
from collections import Counter
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from minirad.course.scenes import (
    CAPTION_PROMPT,
    JSON_PROMPT,
    JSON_TASK,
    QUESTION_TYPES,
    TASK_TYPES,
    ask,
    caption,
    random_scene,
    render,
)
from minirad.course.train import (
    EVAL_SEED,
    MAX_ANSWER_TOKENS,
    QUESTION_WEIGHTS,
    PackedBatcher,
    TrainConfig,
    _accumulate_gradients,
    answer_logits,
    build_model,
    build_processor,
    evaluate,
    generate_answers,
    main,
    make_examples,
)
from minirad.models import DEFAULT_MODEL_DIR
from minirad.models.tokenizer import IM_END, IMAGE_TOKEN, load_tokenizer

TEST_SEED = 20_261_130  # neither the training stream (seed 0 + ...) nor the model card's EVAL_SEED
MAX_BYTES = 10 * 2**20


@cache
def shipped():
    model = AutoModelForImageTextToText.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    processor = AutoProcessor.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    return model.eval(), processor


def test_folder_is_a_standard_hf_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
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
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir())
    assert total < MAX_BYTES
    model, processor = shipped()
    assert isinstance(model, LlavaForConditionalGeneration)
    assert isinstance(processor, LlavaProcessor)
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["text_config"]["model_type"] == "llama"
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert "auto_map" not in config  # loads without trust_remote_code


def test_uses_the_course_tokenizer():
    _, processor = shipped()
    course = load_tokenizer()
    assert processor.tokenizer.get_vocab() == course.get_vocab()
    tok = processor.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", IM_END)] == [
        0,
        1,
        2,
    ]
    model, _ = shipped()
    assert model.config.image_token_id == tok.convert_tokens_to_ids(IMAGE_TOKEN) == 3
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0


def test_prompt_format_and_image_tokens():
    model, processor = shipped()
    scene = random_scene(random.Random(0))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CAPTION_PROMPT}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The processor's template renders like the course tokenizer's ChatML template.
    plain = [{"role": "user", "content": f"{IMAGE_TOKEN}\n{CAPTION_PROMPT}"}]
    assert text == load_tokenizer().apply_chat_template(
        plain, add_generation_prompt=True, tokenize=False
    )
    inputs = processor(images=render(scene), text=text, return_tensors="pt")
    vision = model.config.vision_config
    n_patches = (vision.image_size // vision.patch_size) ** 2
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == n_patches
    assert inputs["pixel_values"].shape == (1, 3, vision.image_size, vision.image_size)


def test_batched_generation_equals_one_at_a_time():
    """generate_answers left-pads prompts of different lengths; each answer must be what an
    unpadded, single-prompt generate() gives."""
    model, processor = shipped()
    rng = random.Random(TEST_SEED + 1)
    images, prompts = [], []
    for task in TASK_TYPES:
        scene = random_scene(rng, objects=[("red", "circle"), ("blue", "square")])
        question = ask(scene, task, rng)
        images.append(render(scene))
        prompts.append(question.prompt)
    batched = generate_answers(model, processor, images, prompts, max_new_tokens=MAX_ANSWER_TOKENS)
    for image, prompt, answer in zip(images, prompts, batched, strict=True):
        content = [{"type": "image"}, {"type": "text", "text": prompt}]
        messages = [{"role": "user", "content": content}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(images=image, text=text, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :]
        assert new[-1] == model.generation_config.eos_token_id  # stopped at <|im_end|>
        assert processor.decode(new, skip_special_tokens=True) == answer


def test_accuracy_on_fresh_scenes():
    model, processor = shipped()
    accuracy = evaluate(model, processor, n_scenes=150, seed=TEST_SEED)
    for task in TASK_TYPES:
        assert accuracy[task] >= 0.95, (task, accuracy)  # the aim, on every task


def test_captions_of_the_chapter_images():
    """The chapters show these images with the model's captions: all but one right (the
    shipped model calls the small triangle of green_triangle_above_yellow_circle a circle,
    and chapter 09 says so). The truth is data/images/README.md's table."""
    model, processor = shipped()
    folder = DEFAULT_MODEL_DIR.parent.parent / "images"
    rows = [line.split("|") for line in (folder / "README.md").read_text().splitlines()]
    captions = {r[1].strip(" `"): r[2].strip() for r in rows if len(r) > 3 and ".png" in r[1]}
    assert len(captions) >= 6
    names = sorted(captions)
    images = [Image.open(folder / name).convert("RGB") for name in names]
    answers = generate_answers(model, processor, images, [CAPTION_PROMPT] * len(names))
    wrong = [n for n, a in zip(names, answers, strict=True) if a != captions[n]]
    assert len(wrong) <= 1, dict(zip(names, answers, strict=True))


def test_wrong_image_gets_wrong_answers():
    """The answers depend on the pixels: a blank image gives no correct caption."""
    model, processor = shipped()
    rng = random.Random(TEST_SEED + 2)
    scenes = [random_scene(rng) for _ in range(20)]
    blank = Image.new("RGB", (scenes[0].size, scenes[0].size), "white")
    answers = generate_answers(model, processor, [blank] * 20, [CAPTION_PROMPT] * 20)
    assert sum(a == caption(s) for a, s in zip(answers, scenes, strict=True)) <= 1


def test_model_card_reports_the_measured_numbers():
    card = (DEFAULT_MODEL_DIR / "README.md").read_text()
    model, _ = shipped()
    total = sum(p.numel() for p in model.parameters())
    assert f"{total:,}" in card
    size = (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size
    assert f"{size:,} bytes" in card
    assert "python -m minirad.course.train --out data/models/minirad-tiny-llava" in card
    assert f"seed {EVAL_SEED}" in card
    assert "Measured training time" in card


def test_packed_batch_equals_one_prompt_at_a_time():
    """Training packs an image's questions into one row (shared image prefix, 4-D mask,
    continued position ids). Each answer's logits must equal those of the plain one-question
    prompt built by the processor, as generate() sees it."""
    tokenizer = load_tokenizer()
    cfg = TrainConfig(vision_hidden=32, vision_mlp=64, text_hidden=32, text_mlp=64)
    processor = build_processor(tokenizer, cfg.image_size, cfg.patch_size)
    torch.manual_seed(0)
    model = build_model(tokenizer, cfg).eval()
    with torch.no_grad():  # random init gives near-flat logits; spread them out
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    rng = random.Random(1)
    examples = make_examples(rng, 2) + make_examples(rng, 2, system_prob=1.0)
    batch = PackedBatcher(processor)(examples)
    with torch.no_grad():
        packed, targets = answer_logits(model, batch)
        expected, expected_targets = [], []
        for image, asked, system in examples:
            for q in asked:
                content = [{"type": "image"}, {"type": "text", "text": q.prompt}]
                turns = [{"role": "system", "content": system}] if system else []
                prompt = processor.apply_chat_template(
                    [*turns, {"role": "user", "content": content}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                inputs = processor(
                    images=image, text=prompt + q.answer + IM_END, return_tensors="pt"
                )
                ids = inputs["input_ids"][0]
                n_answer = len(tokenizer.encode(q.answer + IM_END))
                logits = model(**inputs).logits[0]
                expected.append(logits[len(ids) - n_answer - 1 : -1])
                expected_targets.append(ids[len(ids) - n_answer :])
    assert torch.equal(targets, torch.cat(expected_targets))
    torch.testing.assert_close(packed, torch.cat(expected), atol=1e-5, rtol=1e-5)
    assert len(batch["input_ids"]) == len(examples)  # one row per image


def test_micro_batches_accumulate_the_full_batch_gradient():
    """Training cuts a step's scenes into groups of similar row length; the accumulated
    gradient and loss must be those of the whole batch at once."""
    tokenizer = load_tokenizer()
    cfg = TrainConfig(vision_hidden=32, vision_mlp=64, text_hidden=32, text_mlp=64)
    batcher = PackedBatcher(build_processor(tokenizer, cfg.image_size, cfg.patch_size))
    torch.manual_seed(0)
    model = build_model(tokenizer, cfg)
    examples = make_examples(random.Random(3), 7, questions_per_image=2, json_prob=0.5)
    lengths = sorted(batcher.row_length(e) for e in examples)
    assert lengths[0] < lengths[-1]  # mixed lengths, so the groups differ
    results = []
    for micro_batches in (1, 3):
        model.zero_grad(set_to_none=True)
        loss = _accumulate_gradients(model, batcher, examples, micro_batches)
        # LLaVA reads a hidden layer of the vision tower, so its post_layernorm gets no
        # gradient either way.
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss, grads))
    (loss1, grads1), (loss3, grads3) = results
    whole = batcher(examples)
    logits, targets = answer_logits(model, whole)
    assert abs(loss1 - F.cross_entropy(logits, targets).item()) < 1e-5
    assert abs(loss1 - loss3) < 1e-5
    assert grads1.keys() == grads3.keys()
    assert any(n.startswith("model.language_model") for n in grads1)
    for name, grad in grads1.items():
        torch.testing.assert_close(grad, grads3[name], atol=1e-6, rtol=1e-4)


def test_training_draws_the_hard_questions_more_often():
    """Each scene gets its caption, its JSON listing with probability json_prob, then distinct
    questions, drawn by QUESTION_WEIGHTS; a one-shape scene is never asked its colour."""
    json_prob = TrainConfig().json_prob
    examples = make_examples(random.Random(0), 600, questions_per_image=2, json_prob=json_prob)
    drawn = Counter()
    for example in examples:
        description, *asked = example.questions
        assert description.type == "caption"
        if asked[0].type == JSON_TASK:
            drawn[JSON_TASK] += 1
            asked = asked[1:]
        assert all(q.type in QUESTION_TYPES for q in asked)
        if len(description.answer.split()) == 3:  # one shape: its colour is the caption's
            assert "colour" not in {q.type for q in asked}
        assert len({q.type for q in asked}) == len(asked) == 2
        if len(description.answer.split()) > 3:  # the caption of 2 or 3 shapes, not "a red circle"
            drawn.update(q.type for q in asked)
    # Every scene of 2 or 3 shapes admits "where" (weight 5) and "count" (weight 1).
    assert drawn["where"] > 2 * drawn["count"]
    assert abs(drawn[JSON_TASK] / 600 - json_prob) < 0.06
    assert set(QUESTION_WEIGHTS) == set(QUESTION_TYPES)


def test_training_smoke_run_is_deterministic(tmp_path):
    """Two 2-step runs with the same seed write byte-identical weights that reload with the
    stock Auto classes."""
    threads = torch.get_num_threads()
    outs = [tmp_path / "a", tmp_path / "b"]
    try:
        for out in outs:
            main(["--out", str(out), "--steps", "2", "--eval-every", "2", "--eval-scenes", "2"])
    finally:
        torch.set_num_threads(threads)  # train() fixes its own thread count
    weights = [(out / "model.safetensors").read_bytes() for out in outs]
    assert weights[0] == weights[1]
    model = AutoModelForImageTextToText.from_pretrained(outs[0], local_files_only=True)
    processor = AutoProcessor.from_pretrained(outs[0], local_files_only=True)
    assert isinstance(model, LlavaForConditionalGeneration)
    answers = generate_answers(
        model, processor, [render(random_scene(random.Random(0)))], [CAPTION_PROMPT]
    )
    assert isinstance(answers[0], str)
    card = (outs[0] / "README.md").read_text()
    assert "python -m minirad.course.train --out" in card and "--steps 2" in card
    assert_hub_layout(outs[0] / "model.safetensors")


def assert_hub_layout(path: Path) -> None:
    """The names every LLaVA on the Hub uses, which vLLM's loader expects."""
    with safe_open(path, "pt") as f:
        keys = list(f.keys())
    tower = [k for k in keys if k.startswith("vision_tower.")]
    assert tower and all(k.startswith("vision_tower.vision_model.") for k in tower)
    assert all(
        k.startswith(("vision_tower.", "multi_modal_projector.", "language_model.")) for k in keys
    )


def test_shipped_weights_use_the_hub_layout_and_keep_their_logits(tmp_path):
    """The committed file has the Hub's names, and the same tensors under transformers' own
    names (what it saved before) load to the same model: identical logits."""
    assert_hub_layout(DEFAULT_MODEL_DIR / "model.safetensors")
    native = tmp_path / "native"
    shutil.copytree(DEFAULT_MODEL_DIR, native)
    with safe_open(native / "model.safetensors", "pt") as f:
        tensors = {
            k.replace("vision_tower.vision_model.", "vision_tower."): f.get_tensor(k)
            for k in f.keys()
        }
    save_file(tensors, native / "model.safetensors", metadata={"format": "pt"})
    model, processor = shipped()
    other = AutoModelForImageTextToText.from_pretrained(native, local_files_only=True).eval()
    image = render(random_scene(random.Random(TEST_SEED)))
    text = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": CAPTION_PROMPT}],
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = processor(images=image, text=text, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, other(**inputs).logits)


REQUESTS = DEFAULT_MODEL_DIR.parents[1] / "requests" / "questions.jsonl"
# What the two pictures of data/requests/questions.jsonl show (their file names say it).
TRUTH = {
    "red_circle_left_of_blue_square.png": {
        CAPTION_PROMPT: "a red circle left of a blue square",
        "How many shapes are there?": "two",
        "What colour is the circle?": "red",
        "Is there a red triangle?": "no",
    },
    "purple_circle_green_square_red_triangle.png": {
        CAPTION_PROMPT: "a purple circle, a green square and a red triangle from left to right",
        "How many shapes are there?": "three",
        "What colour is the circle?": "purple",
        "Is there a red triangle?": "yes",
    },
}


def test_readme_main_path(capsys):
    """docs/serving.md's first commands: the shipped model, served by our engine through the CLI,
    answers the shipped questions about the shipped pictures correctly."""
    from minirad.entrypoints.cli import main as cli

    image = DEFAULT_MODEL_DIR.parents[1] / "images" / "purple_circle_green_square_red_triangle.png"
    assert cli(["generate", "--image", str(image), "--prompt", "What colour is the circle?"]) == 0
    assert capsys.readouterr().out == "purple\n"

    # docs/serving.md's JSON example: under the shipped schema, the answer lists the shapes.
    schema = DEFAULT_MODEL_DIR.parents[1] / "schemas" / "shapes.schema.json"
    argv = ["--prompt", JSON_PROMPT, "--json-schema", str(schema), "--max-new-tokens", "128"]
    assert cli(["generate", "--image", str(image), *argv]) == 0
    listed = json.loads(capsys.readouterr().out)["shapes"]
    assert [(s["colour"], s["shape"]) for s in listed] == [
        ("purple", "circle"),
        ("green", "square"),
        ("red", "triangle"),
    ]

    assert cli(["batch", str(REQUESTS)]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in REQUESTS.read_text().splitlines()]
    assert len(rows) == 8
    for i, row in enumerate(rows):
        name = Path(row["images"][0]).name
        assert f"[{i}] {row['prompt']} ({name})\n    -> {TRUTH[name][row['prompt']]}\n" in out
    [encoder] = [line for line in out.splitlines() if line.startswith("encoder calls")]
    assert encoder.split()[2:4] == ["2", "made,"]  # one vision-tower run per picture
