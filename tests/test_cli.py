"""The ``minirad`` command (``minirad.cli.main``) on a tiny config-built LLaVA saved to disk.

The reference for every answer is Hugging Face ``generate()`` on the same templated prompt;
the cache statistics are checked against what the requests share (a prefix, an image).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import IMAGE_SIZE, LLAVA_IMAGE_TOKENS, tiny_llava, tiny_llava_processor

from minirad.cli import chat_prompt, main

# A chat template over the tiny word-level vocabulary ("w4" .. "w95" are words): the role
# and turn markers are ordinary words, so the prompt tokenizes without unknown tokens.
TINY_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}"
    "{{ ' w4' if message['role'] == 'system' else ' w5' }}"
    "{% if message['content'] is string %}{{ ' ' + message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ ' <image>' }}"
    "{% else %}{{ ' ' + item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ ' w6' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' w7' }}{% endif %}"
)
MAX_NEW = 6


def make_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny LLaVA + processor (with a chat template), and two PNGs next to it."""
    root = tmp_path_factory.mktemp("cli")
    model, processor = tiny_llava(), tiny_llava_processor()
    processor.chat_template = TINY_CHAT_TEMPLATE
    model.save_pretrained(root / "model")
    processor.save_pretrained(root / "model")
    for seed in (1, 2):
        make_image(seed).save(root / f"img{seed}.png")
    return root, model, processor


@torch.no_grad()
def hf_answer(model, processor, prompt: str, images: list[Path], max_new: int = MAX_NEW) -> str:
    """HF's greedy answer to ``prompt`` (templated as the CLI does)."""
    text = chat_prompt(processor, prompt, len(images))
    pil = [Image.open(p) for p in images]
    inputs = processor(text=text, images=pil or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_chat_prompt_places_one_placeholder_per_image(tiny_dir):
    _, _, processor = tiny_dir
    text = chat_prompt(processor, "w10 w11", 2)
    assert text.count("<image>") == 2 and text.endswith("w10 w11 w6 w7")
    ids = processor(text=text, images=[make_image(1), make_image(2)])["input_ids"][0]
    assert list(ids).count(3) == 2 * LLAVA_IMAGE_TOKENS


@pytest.mark.parametrize("stream", [False, True])
def test_generate_matches_hf(tiny_dir, capsys, stream):
    root, model, processor = tiny_dir
    image = root / "img1.png"
    argv = ["generate", "--model", str(root / "model"), "--image", str(image)]
    argv += ["--prompt", "w10 w11 w12", "--max-new-tokens", str(MAX_NEW)]
    assert main(argv + ["--stream"] * stream) == 0
    out = capsys.readouterr().out
    assert out == hf_answer(model, processor, "w10 w11 w12", [image]) + "\n"
    assert out.strip()  # the tiny model's words are not special tokens


def test_generate_raw_prompt_and_sampling(tiny_dir, capsys):
    """--raw sends the text as written; a seeded sampled answer is reproducible."""
    root, model, processor = tiny_dir
    argv = ["generate", "--model", str(root / "model"), "--image", str(root / "img2.png")]
    argv += ["--raw", "--prompt", "<s> w20 <image> w21", "--max-new-tokens", str(MAX_NEW)]
    assert main(argv) == 0
    inputs = processor(text="<s> w20 <image> w21", images=[make_image(2)], return_tensors="pt")
    ref = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    expected = processor.decode(ref[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert capsys.readouterr().out == expected + "\n"
    sampled = argv + ["--temperature", "1.5", "--top-k", "20", "--top-p", "0.9", "--seed", "7"]
    assert main(sampled) == 0
    first = capsys.readouterr().out
    assert main(sampled) == 0
    assert capsys.readouterr().out == first


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Four requests: two questions about img1 (shared template prefix + image), one about img2,
# and the first again with its own max_new_tokens.
ROWS = [
    {"prompt": "w10 w11", "images": ["img1.png"]},
    {"prompt": "w12 w13 w14", "images": ["img1.png"]},
    {"prompt": "w10 w11", "images": ["img2.png"]},
    {"prompt": "w10 w11", "images": ["img1.png"], "max_new_tokens": 3},
]


def stat(out: str, name: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.startswith(name)]
    return line[len(name) :].strip()


def test_batch_prints_answers_and_cache_stats(tiny_dir, capsys):
    root, model, processor = tiny_dir
    jsonl = write_jsonl(root / "requests.jsonl", ROWS)
    argv = ["batch", str(jsonl), "--model", str(root / "model"), "--max-new-tokens", str(MAX_NEW)]
    assert main(argv + ["--page-size", "2", "--policy", "lpm"]) == 0
    out = capsys.readouterr().out
    for i, row in enumerate(ROWS):
        images = [root / p for p in row["images"]]
        answer = hf_answer(
            model, processor, row["prompt"], images, row.get("max_new_tokens", MAX_NEW)
        )
        names = ", ".join(p.name for p in images)
        assert f"[{i}] {row['prompt']} ({names})\n    -> {answer}\n" in out
    assert stat(out, "requests") == "4"
    assert stat(out, "encoder calls").startswith("2 made")  # two distinct images
    assert not stat(out, "prefix hit rate").startswith("0.0%")
    computed, saved = (int(w) for w in stat(out, "prefill tokens").split()[::2])
    assert saved > 0 and computed + saved == int(stat(out, "prompt tokens"))
    assert stat(out, "preemptions") == "0"
    assert "pages of 2" in stat(out, "KV slots at peak")

    assert main(argv + ["--prefix-strategy", "none"]) == 0
    none = capsys.readouterr().out
    assert stat(none, "prefix hit rate").startswith("0.0%")
    assert int(stat(none, "prefill tokens").split()[0]) > computed


def test_batch_with_a_tight_pool_preempts_and_still_answers(tiny_dir, capsys):
    root, _, _ = tiny_dir
    jsonl = write_jsonl(root / "requests.jsonl", ROWS)
    argv = ["batch", str(jsonl), "--model", str(root / "model"), "--max-new-tokens", str(MAX_NEW)]
    assert main(argv) == 0
    roomy = capsys.readouterr().out
    peak = int(stat(roomy, "KV slots at peak").split()[0])
    assert main(argv + ["--num-kv-slots", str(peak - 8)]) == 0
    tight = capsys.readouterr().out
    assert tight.split("\n\n")[0] == roomy.split("\n\n")[0]  # the same answers
    assert int(stat(tight, "KV slots at peak").split()[0]) <= peak - 8
    assert int(stat(tight, "preemptions")) >= 1


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["generate", "--model", "{root}/nowhere", "--prompt", "w10"], "model folder"),
        (["generate", "--model", "{root}", "--prompt", "w10"], "cannot load a model"),
        (["generate", "--image", "{root}/missing.png", "--prompt", "w10"], "missing.png"),
        (["batch", "{root}/bad.jsonl", "--model", "{root}/model"], "bad.jsonl:2: not valid JSON"),
        (["batch", "{root}/noimg.jsonl", "--model", "{root}/model"], "nope.png' not found"),
        (["batch", "{root}/field.jsonl", "--model", "{root}/model"], "unknown fields ['colour']"),
        (["batch", "{root}/none.jsonl", "--model", "{root}/model"], "cannot read"),
        (["batch", "{root}/temp.jsonl", "--model", "{root}/model"], "temperature must be >= 0"),
        (
            ["generate", "--model", "{root}/model", "--image", "{root}/img1.png", "--raw"]
            + ["--prompt", "w10"],
            "0 '<image>' placeholder(s) but 1 image(s)",
        ),
    ],
)
def test_errors_print_one_line_and_exit_2(tiny_dir, capsys, argv_tail, message):
    root, _, _ = tiny_dir
    (root / "bad.jsonl").write_text('{"prompt": "w10", "images": []}\n{"prompt": \n')
    write_jsonl(root / "noimg.jsonl", [{"prompt": "w10", "images": ["nope.png"]}])
    write_jsonl(root / "field.jsonl", [{"prompt": "w10", "colour": "red"}])
    write_jsonl(root / "temp.jsonl", [{"prompt": "w10", "temperature": -1}])
    argv = [a.replace("{root}", str(root)) for a in argv_tail]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err
    assert captured.err.startswith(f"minirad {argv[0]}: error:")


def test_python_dash_m_runs_the_cli():
    """``python -m minirad`` is the same command; argparse's usage error is status 2."""
    run = subprocess.run(
        [sys.executable, "-m", "minirad", "generate", "--model", "/nonexistent", "--prompt", "x"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == "minirad generate: error: model folder '/nonexistent' not found"
    assert subprocess.run([sys.executable, "-m", "minirad"], capture_output=True).returncode == 2
