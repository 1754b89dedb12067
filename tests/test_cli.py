"""The ``minirad`` command (``minirad.entrypoints.cli.main``) on a tiny config-built LLaVA saved to
disk.

The reference for every answer is Hugging Face ``generate()`` on the same templated prompt;
the cache statistics are checked against what the requests share (a prefix, an image).
"""

import argparse
import contextlib
import io
import json
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import IMAGE_SIZE, LLAVA_IMAGE_TOKENS, tiny_llava, tiny_llava_processor

from minirad.entrypoints.argtypes import DTYPES
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.entrypoints.cli import build_parser, cut_note, finish_note, main
from minirad.entrypoints.commands.inputs import JSONL_FIELDS

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
    policies = ["--schedule-policy", "lpm", "--radix-eviction-policy", "slru"]
    assert main(argv + ["--page-size", "2", *policies]) == 0
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
    assert stat(out, "preemptions").split()[0] == "0"
    assert "pages of 2" in stat(out, "KV slots at peak")

    assert main(argv + ["--prefix-strategy", "none"]) == 0
    none = capsys.readouterr().out
    assert stat(none, "prefix hit rate").startswith("0.0%")
    assert int(stat(none, "prefill tokens").split()[0]) > computed


def roomy_batch(tiny_dir, capsys) -> tuple[list[str], str, int]:
    """ROWS through ``minirad batch`` on the default pool: its argv, output and peak slots."""
    root, _, _ = tiny_dir
    jsonl = write_jsonl(root / "requests.jsonl", ROWS)
    argv = ["batch", str(jsonl), "--model", str(root / "model"), "--max-new-tokens", str(MAX_NEW)]
    assert main(argv) == 0
    roomy = capsys.readouterr().out
    return argv, roomy, int(stat(roomy, "KV slots at peak").split()[0])


def test_batch_with_a_tight_pool_preempts_and_still_answers(tiny_dir, capsys):
    argv, roomy, peak = roomy_batch(tiny_dir, capsys)
    assert main(argv + ["--num-kv-slots", str(peak - 8)]) == 0
    tight = capsys.readouterr().out
    assert tight.split("\n\n")[0] == roomy.split("\n\n")[0]  # the same answers
    assert int(stat(tight, "KV slots at peak").split()[0]) <= peak - 8
    assert int(stat(tight, "preemptions").split()[0]) >= 1


def test_batch_with_a_host_tier_answers_the_same_and_counts_host_hits(tiny_dir, capsys):
    """A pool too small to keep the first image's prompt while the second runs: with a host
    tier the fourth line finds it there (the summary's by-source row), answers unchanged."""
    argv, roomy, peak = roomy_batch(tiny_dir, capsys)
    tight = argv + ["--num-kv-slots", str(peak // 2)]
    assert main(tight + ["--enable-hierarchical-cache", "--hicache-ratio", "4"]) == 0
    tiered = capsys.readouterr().out
    assert tiered.split("\n\n")[0] == roomy.split("\n\n")[0]  # the same answers
    sources = dict(reversed(w.split()) for w in stat(tiered, "cached tokens by source").split(","))
    assert set(sources) == {"device", "host", "storage"} and int(sources["host"]) > 0
    assert sum(map(int, sources.values())) == int(stat(tiered, "prefill tokens").split()[2])
    assert "cached tokens by source" not in roomy


@pytest.mark.parametrize(
    "flags",
    [
        ["--hicache-ratio", "2"],
        ["--hicache-storage-dir", "x"],
        ["--hicache-write-policy", "write_back"],
    ],
)
def test_hicache_flags_need_the_switch(tiny_dir, flags, capsys):
    root, _, _ = tiny_dir
    jsonl = write_jsonl(root / "requests.jsonl", ROWS)
    assert main(["batch", str(jsonl), "--model", str(root / "model"), *flags]) == 2
    assert "--enable-hierarchical-cache" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["generate", "--model", "{root}/nowhere", "--prompt", "w10"], "model folder"),
        (["generate", "--model", "{root}", "--prompt", "w10"], "has no config.json"),
        (["generate", "--model", "{root}/broken", "--prompt", "w10"], "cannot load a model"),
        (["generate", "--image", "{root}/missing.png", "--prompt", "w10"], "missing.png"),
        (["batch", "{root}/bad.jsonl", "--model", "{root}/model"], "bad.jsonl:2: not valid JSON"),
        (["batch", "{root}/noimg.jsonl", "--model", "{root}/model"], "noimg.jsonl:1: image"),
        (["batch", "{root}/field.jsonl", "--model", "{root}/model"], "unknown fields ['colour']"),
        (["batch", "{root}/none.jsonl", "--model", "{root}/model"], "cannot read"),
        (
            ["batch", "{root}/temp.jsonl", "--model", "{root}/model"],
            "temperature must be a finite number >= 0",
        ),
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
    (root / "broken").mkdir(exist_ok=True)
    (root / "broken" / "config.json").write_text("{}")
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


def test_help_and_argument_errors_do_not_import_torch():
    """``import minirad`` and the parser stay light (PEP 562 names, commands import lazily),
    so ``minirad --help`` and a bad argument answer at once; the names still resolve."""
    code = textwrap.dedent(
        """
        import contextlib, io, sys
        import minirad
        assert "torch" not in sys.modules, "import minirad"
        from minirad.entrypoints.cli import main
        quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
        for argv in (["--help"], ["generate", "--help"], ["batch", "x", "--schedule-policy", "no"],
                     ["batch", "x", "--policy", "lru"], ["generate", "--prompt", ""]):
            with quiet[0], quiet[1], contextlib.suppress(SystemExit):
                main(argv)
            heavy = {"torch", "transformers"} & set(sys.modules)
            assert not heavy, (argv, heavy)
        from minirad import KVCacheManager, RadixCache, pad_value
        assert set(minirad.__all__) <= set(dir(minirad))
        assert all(getattr(minirad, name) is not None for name in minirad.__all__)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def subparser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def test_parser_choices_are_the_engines():
    from minirad.engine import PREFIX_STRATEGIES, SCHEDULE_POLICIES
    from minirad.kvcache.eviction import EVICTION_POLICIES
    from minirad.kvcache.hiradix_cache import WRITE_POLICIES
    from minirad.models import DEFAULT_MODEL_DIR

    args = build_parser().parse_args(["batch", "x.jsonl"])
    assert args.model == str(DEFAULT_MODEL_DIR)
    for command in ("batch", "serve"):
        choices = {a.dest: a.choices for a in subparser(command)._actions if a.choices}
        assert choices == {
            "prefix_strategy": PREFIX_STRATEGIES,
            "schedule_policy": tuple(SCHEDULE_POLICIES),
            "radix_eviction_policy": tuple(EVICTION_POLICIES),
            "dtype": DTYPES,
            "hicache_write_policy": WRITE_POLICIES,
        }
    assert all(getattr(torch, name).is_floating_point for name in DTYPES)


def test_every_engine_command_names_the_policies_as_sglang_does():
    """One flag per kind of policy, the same in every command that has a queue to order
    (``batch``, ``serve``) or a tree to evict from (those and ``explain``), with SGLang's names
    and, where we implement the same policy, its choices (sglang/srt/arg_groups). ``generate``
    serves one request on a fresh engine: it has neither."""
    from minirad.engine import SCHEDULE_POLICIES
    from minirad.kvcache.eviction import EVICTION_POLICIES

    flags = {
        "--schedule-policy": "schedule_policy",
        "--radix-eviction-policy": "radix_eviction_policy",
    }
    expected = {
        "generate": set(),
        "batch": set(flags),
        "serve": set(flags),
        "explain": {"--radix-eviction-policy"},
    }
    sglang_schedule = {"lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key",
                       "hrrn", "shortest-prefill-first"}  # fmt: skip
    sglang_eviction = {"lru", "lfu", "slru", "priority", "tlru"}
    assert set(SCHEDULE_POLICIES) <= sglang_schedule
    assert sglang_eviction <= set(EVICTION_POLICIES) <= sglang_eviction | {"fifo"}
    for command, shown in expected.items():
        parser = subparser(command)
        visible = {
            option
            for a in parser._actions
            if a.help != argparse.SUPPRESS
            for option in a.option_strings
            if "polic" in option and "hicache" not in option
        }
        assert visible == shown, command
        required = {"generate": ["--prompt", "w10"], "batch": ["x.jsonl"]}
        args = parser.parse_args(required.get(command, []))
        for flag in shown:
            assert getattr(args, flags[flag]) == {"--schedule-policy": "fcfs"}.get(flag, "lru")


@pytest.mark.parametrize(
    "command, old, new, value",
    [
        (["batch", "x.jsonl"], "--policy", "--schedule-policy", "lpm"),
        (["serve"], "--policy", "--schedule-policy", "lpm"),
        (["explain", "t.jsonl"], "--policy", "--radix-eviction-policy", "fifo"),
    ],
)
def test_the_old_policy_flag_is_a_hidden_alias_that_says_what_to_use(
    capsys, command, old, new, value
):
    """``--policy`` meant the scheduling order in ``batch``/``serve`` and the eviction policy
    in ``explain``: it keeps that meaning, is left out of ``--help``, and warns; a value of the
    other kind is refused after the warning, which names both flags."""
    args = build_parser().parse_args([*command, old, value])
    assert getattr(args, new.removeprefix("--").replace("-", "_")) == value
    err = capsys.readouterr().err
    assert err == f"minirad {command[0]}: warning: {old} is deprecated: use {new}" + (
        " (--radix-eviction-policy chooses the eviction policy)\n" if "schedule" in new else "\n"
    )
    assert old + " " not in subparser(command[0]).format_help()
    if command[0] == "batch":
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([*command, old, "lru"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--radix-eviction-policy chooses the eviction policy" in err
        assert "argument --policy: invalid choice: 'lru' (choose from 'fcfs', 'lpm')" in err


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt_is_refused_by_generate_and_batch(tiny_dir, capsys, prompt):
    """One rule: a prompt must hold a non-space character, on the command line or in JSONL."""
    root, _, _ = tiny_dir
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(root / "model"), "--prompt", prompt])
    assert exit_.value.code == 2
    assert "argument --prompt: must hold a non-space character" in capsys.readouterr().err
    jsonl = write_jsonl(root / "empty.jsonl", [{"prompt": prompt, "images": ["img1.png"]}])
    assert main(["batch", str(jsonl), "--model", str(root / "model")]) == 2
    err = capsys.readouterr().err
    assert f"{jsonl}:1: 'prompt' must be a string with a non-space character" in err


def test_no_image_runs_with_a_warning(tiny_dir, capsys):
    root, model, processor = tiny_dir
    argv = ["generate", "--model", str(root / "model"), "--prompt", "w10 w11"]
    assert main(argv + ["--max-new-tokens", str(MAX_NEW)]) == 0
    captured = capsys.readouterr()
    assert captured.out == hf_answer(model, processor, "w10 w11", []) + "\n"
    warning, finish = captured.err.splitlines()
    assert warning.startswith("minirad generate: warning: no image given")
    assert finish.startswith("finish_reason: ")
    jsonl = write_jsonl(root / "text.jsonl", [ROWS[0], {"prompt": "w10 w11"}])
    assert main(["batch", str(jsonl), "--model", str(root / "model")]) == 0
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"minirad batch: warning: {jsonl}:2: no image given")


def test_several_images_go_before_the_question_in_order(tiny_dir, capsys):
    """Without --raw, N --image flags are N image items before the question (as HF's chat
    template places them for vLLM's chat endpoint); the order matters."""
    root, model, processor = tiny_dir
    images = [root / "img1.png", root / "img2.png"]
    argv = ["generate", "--model", str(root / "model"), "--prompt", "w10 w11"]
    argv += ["--max-new-tokens", str(MAX_NEW)]
    answers = []
    for order in (images, images[::-1]):
        assert main(argv + [a for p in order for a in ("--image", str(p))]) == 0
        captured = capsys.readouterr()
        answers.append(captured.out)
        assert answers[-1] == hf_answer(model, processor, "w10 w11", order) + "\n"
        note = captured.err.splitlines()[0]
        assert note == (
            "minirad generate: note: 2 images go before the question, in the order given "
            "(first image first)"
        )  # not the shipped model: no claim about its training


def test_several_images_with_the_shipped_model_say_it_learned_one():
    from minirad.models import DEFAULT_MODEL_DIR

    image = DEFAULT_MODEL_DIR.parents[1] / "images" / "red_circle_left_of_blue_square.png"
    argv = ["generate", "--image", str(image), "--image", str(image), "--prompt", "What is it?"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv + ["--max-new-tokens", "1"]) == 0
    assert err.getvalue().splitlines()[0] == (
        "minirad generate: note: 2 images go before the question, in the order given (first "
        "image first); minirad-tiny-llava was trained on one image per prompt"
    )


def test_a_placeholder_in_a_plain_prompt_is_refused(tiny_dir, capsys):
    root, _, _ = tiny_dir
    argv = ["generate", "--model", str(root / "model"), "--image", str(root / "img1.png")]
    assert main(argv + ["--prompt", "w10 <image> w11"]) == 2
    err = capsys.readouterr().err
    assert "the prompt contains '<image>': without --raw the images go before the question" in err
    jsonl = write_jsonl(root / "ph.jsonl", [ROWS[0], {"prompt": "<image> w10", "images": []}])
    assert main(["batch", str(jsonl), "--model", str(root / "model")]) == 2
    assert f"{jsonl}:2: the prompt contains '<image>'" in capsys.readouterr().err


def huge_png(path: Path, width: int, height: int) -> Path:
    """A 1-bit PNG of ``width`` x ``height`` (all black: it compresses to a few kB)."""
    Image.new("1", (width, height)).save(path)
    return path


@pytest.mark.parametrize("side", [12000, 20000])  # above PIL's warning and its error limits
def test_a_huge_image_is_refused_before_loading(tiny_dir, tmp_path, capsys, side):
    """PIL's decompression-bomb warning (with its site-packages path) never reaches the user;
    the image is refused from its header, before the model loads."""
    root, _, _ = tiny_dir
    image = huge_png(tmp_path / "huge.png", side, side)
    argv = ["generate", "--model", str(root / "nowhere"), "--prompt", "w10"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(argv + ["--image", str(image)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "downscale it first" in err and "huge.png" in err
    assert ("12000x12000 (144,000,000 pixels)" in err) == (side == 12000)
    assert "site-packages" not in err and "model folder" not in err


def test_bad_image_paths_say_what_they_are(tiny_dir, tmp_path, capsys):
    root, _, _ = tiny_dir
    (tmp_path / "notes.png").write_text("not a picture")
    argv = ["generate", "--model", str(root / "nowhere"), "--prompt", "w10", "--image"]
    for image, message in [
        (tmp_path, "is a directory, not an image file"),
        (tmp_path / "notes.png", "is not a readable image (PNG, JPEG, WebP, GIF or BMP)"),
    ]:
        assert main(argv + [str(image)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "model folder" not in err


def test_batch_names_the_line_and_the_resolved_path_of_a_missing_image(
    tiny_dir, capsys, monkeypatch
):
    root, _, _ = tiny_dir
    (root / "sub").mkdir(exist_ok=True)
    rows = [{"prompt": "w1", "images": ["../img1.png"]}, {"prompt": "w1", "images": ["x.png"]}]
    write_jsonl(root / "sub" / "r.jsonl", rows)
    monkeypatch.chdir(root)
    assert main(["batch", "sub/r.jsonl", "--model", str(root / "model")]) == 2
    resolved = str((root / "sub" / "x.png").resolve())
    assert capsys.readouterr().err == (
        f"minirad batch: error: sub/r.jsonl:2: image 'x.png' (resolved: {resolved!r}) not found\n"
    )


def finish_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("finish_reason")]


def test_generate_says_why_it_stopped(tiny_dir, capsys):
    """``length`` names its cause: max_new_tokens, or the context (the tiny model's
    max_position_embeddings, 256) full before it."""
    root, _, processor = tiny_dir
    argv = ["generate", "--model", str(root / "model"), "--image", str(root / "img1.png")]
    argv += ["--prompt", "w10 w11"]
    assert main(argv + ["--max-new-tokens", "3"]) == 0
    assert finish_lines(capsys.readouterr().err) == [
        "finish_reason: length (max_new_tokens 3 reached)"
    ]
    for stream in ([], ["--stream"]):
        assert main(argv + ["--max-new-tokens", "1000"] + stream) == 0
        captured = capsys.readouterr()
        prompt = len(
            processor(text=chat_prompt(processor, "w10 w11", 1), images=[make_image(1)])[
                "input_ids"
            ][0]
        )
        assert finish_lines(captured.err) == [
            f"finish_reason: length (the context is full: {prompt} prompt + {256 - prompt} "
            f"output tokens = max_model_len 256, before max_new_tokens 1000)"
        ]


def test_finish_note_for_a_stop_token(tiny_dir):
    from minirad.engine import GenerateRequest, LLMEngine, SamplingParams

    root, _, processor = tiny_dir
    engine = LLMEngine.from_pretrained(root / "model")
    text = chat_prompt(processor, "w10 w11", 1)
    image = [str(root / "img1.png")]
    (first,) = engine.generate([GenerateRequest(text, image, SamplingParams(max_new_tokens=3))])
    stop = SamplingParams(max_new_tokens=9, stop_token_ids=[first.token_ids[1]])
    (out,) = engine.generate([GenerateRequest(text, image, stop)])
    assert out.finish_reason == "stop"
    assert (
        finish_note(out, 9, engine.max_model_len)
        == "finish_reason: stop (stop token after 2 tokens)"
    )


def test_batch_prints_each_finish_reason(tiny_dir, capsys):
    root, _, _ = tiny_dir
    rows = [ROWS[0] | {"max_new_tokens": 2}, ROWS[1] | {"max_new_tokens": 1000}]
    jsonl = write_jsonl(root / "finish.jsonl", rows)
    assert main(["batch", str(jsonl), "--model", str(root / "model")]) == 0
    first, second = finish_lines(capsys.readouterr().out)
    assert first == "finish_reason: length (max_new_tokens 2 reached)"
    assert second.startswith("finish_reason: length (the context is full: ")


def test_bad_inputs_are_refused_before_the_engine_import(tiny_dir, tmp_path):
    """Every error a user can make in the flags, the prompt or the JSONL file is found before
    torch and transformers are imported (the engine import and model load take seconds)."""
    root, _, _ = tiny_dir
    model, img = str(root / "model"), str(root / "img1.png")
    files = {
        "empty.jsonl": "\n\n",
        "bad.jsonl": '{"prompt": "w10"}\n{"prompt": \n',
        "list.jsonl": '["w10"]\n',
        "field.jsonl": '{"prompt": "w10", "image": "img1.png"}\n',
        "blank.jsonl": '{"prompt": " "}\n',
        "images.jsonl": '{"prompt": "w10", "images": "img1.png"}\n',
        "topk.jsonl": '{"prompt": "w10", "top_k": 1.5}\n',
        "late.jsonl": '{"prompt": "w10"}\n' * 3 + '{"prompt": "w10", "top_p": 0}\n',
        "two.jsonl": '{"prompt": "w10"}\n{"prompt": "w10", "regex": "a", "choice": ["a"]}\n',
        "schema.jsonl": '{"prompt": "w10", "json_schema": [1]}\n',
        "nochoice.jsonl": '{"prompt": "w10", "choice": []}\n',
        "noregex.jsonl": '{"prompt": "w10", "regex": ""}\n',
        "list.json": "[1, 2]",
        "notjson.json": '{"type": "object",\n',
        "latin1.json": b"\xff\xfe".decode("latin-1"),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="latin-1")
    (tmp_path / "dir.jsonl").mkdir()
    gen = ["generate", "--model", model, "--prompt", "w10"]
    schema = ["--json-schema", str(tmp_path / "schema.json")]
    cases = [
        (gen + schema, "cannot read JSON schema file '" + str(tmp_path / "schema.json")),
        (
            gen + ["--json-schema", str(tmp_path)],
            f"cannot read JSON schema file {str(tmp_path)!r}: Is a directory",
        ),
        (
            gen + ["--json-schema", str(tmp_path / "notjson.json")],
            "notjson.json' is not JSON: Expecting property name enclosed in double quotes "
            "at line 2 column 1",
        ),
        (
            gen + ["--json-schema", str(tmp_path / "latin1.json")],
            "latin1.json': not UTF-8",
        ),
        (gen + ["--json-schema", str(tmp_path / "list.json")], "holds a list, not a schema"),
        (gen + ["--choice"], "argument --choice: expected at least one argument"),
        (gen + ["--choice", "a", ""], "choice must be a non-empty list of non-empty strings"),
        (gen + ["--regex", ""], "regex must be a non-empty string"),
        (gen + ["--regex", "a", "--choice", "a"], "argument --choice: not allowed with argument"),
        (gen + schema + ["--regex", "a"], "argument --regex: not allowed with argument"),
        (
            ["batch", str(tmp_path / "two.jsonl")],
            "two.jsonl:2: give at most one of json_schema, regex, choice; got ['regex', 'choice']",
        ),
        (["batch", str(tmp_path / "schema.jsonl")], "schema.jsonl:1: json_schema must be a JSON"),
        (["batch", str(tmp_path / "nochoice.jsonl")], "nochoice.jsonl:1: choice must be a non-"),
        (["batch", str(tmp_path / "noregex.jsonl")], "noregex.jsonl:1: regex must be a non-empty"),
        (gen + ["--temperature", "-1"], "--temperature: must be a finite number >= 0, got -1.0"),
        (gen + ["--temperature", "inf"], "--temperature: must be a finite number >= 0, got inf"),
        (gen + ["--top-p", "2"], "argument --top-p: must be in (0, 1], got 2.0"),
        (gen + ["--top-k", "-5"], "argument --top-k: must be an int >= 0 (0: off), got -5"),
        (gen + ["--threads", "99999"], "argument --threads: must be at most"),  # crashed
        (gen + ["--image", img, "--prompt", "w10 <image>"], "the prompt contains '<image>'"),
        (gen + ["--image", img, "--raw"], "has 0 '<image>' placeholder(s) but 1 image(s)"),
        (gen + ["--raw", "--prompt", "<image> w1"], "1 '<image>' placeholder(s) but 0 image(s)"),
        (["generate", "--model", "/nonexistent", "--prompt", "x"], "'/nonexistent' not found"),
        (["generate", "--model", str(root), "--prompt", "x"], "has no config.json"),
        (["batch", str(tmp_path / "none.jsonl")], "none.jsonl': No such file or directory"),
        (["batch", str(tmp_path / "dir.jsonl")], "dir.jsonl': Is a directory"),
        (["batch", str(tmp_path / "empty.jsonl")], "empty.jsonl: no requests"),
        (["batch", str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not valid JSON"),
        (["batch", str(tmp_path / "list.jsonl")], "list.jsonl:1: expected a JSON object"),
        (
            ["batch", str(tmp_path / "field.jsonl")],
            "field.jsonl:1: unknown fields ['image']; a line may hold prompt, images, "
            "max_new_tokens, temperature, top_k, top_p, seed, json_schema, regex, choice",
        ),
        (["batch", str(tmp_path / "blank.jsonl")], "blank.jsonl:1: 'prompt' must be a string"),
        (["batch", str(tmp_path / "images.jsonl")], "images.jsonl:1: 'images' must be a list"),
        (["batch", str(tmp_path / "topk.jsonl")], "topk.jsonl:1: top_k must be an int >= 0"),
        (["batch", str(tmp_path / "late.jsonl")], "late.jsonl:4: top_p must be in (0, 1]"),
        (
            ["batch", str(tmp_path / "late.jsonl"), "--page-size", "3"],
            "--num-kv-slots 4096 is not a multiple of --page-size 3",
        ),
        (
            ["batch", str(tmp_path / "late.jsonl"), "--model", "/nonexistent"],
            "late.jsonl:4: top_p",  # the whole file is checked before the model folder
        ),
    ]
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from minirad.entrypoints.cli import main
        results = []
        for argv in json.loads(sys.argv[1]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    status = main(argv)
                except SystemExit as e:
                    status = e.code
            heavy = sorted({"torch", "transformers"} & set(sys.modules))
            results.append([status, err.getvalue(), heavy])
        print(json.dumps(results))
        """
    )
    argvs = [argv if "--model" in argv else argv + ["--model", model] for argv, _ in cases]
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    for (argv, message), (status, err, heavy) in zip(cases, json.loads(run.stdout), strict=True):
        assert (status, heavy) == (2, []), (argv, err)
        assert message in err.splitlines()[-1], (argv, err)


def test_a_pool_too_small_names_the_line_and_the_flag(tiny_dir, capsys):
    root, _, processor = tiny_dir
    n = len(
        processor(text=chat_prompt(processor, "w10", 1), images=[make_image(1)])["input_ids"][0]
    )
    rows = [
        {"prompt": "w10", "images": ["img1.png"], "max_new_tokens": 1},
        {"prompt": "w10", "images": ["img1.png"], "max_new_tokens": 20},
    ]
    jsonl = write_jsonl(root / "pool.jsonl", rows)
    argv = ["batch", str(jsonl), "--model", str(root / "model"), "--num-kv-slots", str(n + 4)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"minirad batch: error: {jsonl}:2: request needs up to ")
    assert captured.err.endswith(f"; raise --num-kv-slots (now {n + 4})\n")


def test_device_dtype_and_policy_flags_reach_the_engine(tiny_dir, capsys, monkeypatch):
    """``--device cpu --dtype bfloat16``: the engine the command builds (kept by a pass-through
    around ``LLMEngine.from_pretrained``) runs in bf16, KV pool included, on the CPU; and its
    scheduler and tree take ``--schedule-policy`` and ``--radix-eviction-policy``."""
    from minirad.engine import LLMEngine

    root, _, _ = tiny_dir
    built = []
    real = LLMEngine.from_pretrained.__func__

    def keep(cls, *args, **kwargs):
        built.append(real(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(LLMEngine, "from_pretrained", classmethod(keep))
    jsonl = write_jsonl(root / "requests.jsonl", ROWS)
    argv = ["batch", str(jsonl), "--model", str(root / "model"), "--max-new-tokens", str(MAX_NEW)]
    policies = ["--schedule-policy", "lpm", "--radix-eviction-policy", "fifo"]
    assert main(argv + ["--device", "cpu", "--dtype", "bfloat16", *policies]) == 0
    assert capsys.readouterr().out.count("\n    -> ") == len(ROWS)
    (engine,) = built
    assert engine.device == torch.device("cpu") and engine.dtype == torch.bfloat16
    assert engine.kv_cache.k_cache.dtype == torch.bfloat16
    assert engine.config.policy == "lpm" and engine.scheduler.schedule_policy.name == "lpm"
    assert engine.tree_cache.eviction_policy.name == "fifo"
    for command in (["generate", "--prompt", "w10"], ["serve"]):
        args = build_parser().parse_args(command)
        assert (args.device, args.dtype) == ("cpu", "float32")  # the defaults


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "device, message",
    [
        ("gpu", "--device: device 'gpu' is not a torch device (write e.g. 'cpu', 'cuda'"),
        pytest.param(
            "cuda",
            "--device: device 'cuda' is not available: torch.cuda.is_available() is False",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
    ],
)
def test_a_bad_device_is_one_line_and_exit_2_in_every_command(tiny_dir, capsys, device, message):
    root, _, _ = tiny_dir
    model = str(root / "model")
    jsonl = write_jsonl(root / "requests.jsonl", ROWS)
    for argv in (
        ["generate", "--model", model, "--prompt", "w10", "--image", str(root / "img1.png")],
        ["batch", str(jsonl), "--model", model],
        ["serve", "--model", model, "--port", str(free_port())],
    ):
        assert main([*argv, "--device", device]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert captured.err.startswith(f"minirad {argv[0]}: error: {message}")
        assert captured.err.endswith("available here: cpu\n") or torch.cuda.is_available()


def test_a_bad_device_or_dtype_is_not_a_traceback(tiny_dir):
    """``python -m minirad`` too: exit 2 and one line; a dtype outside --dtype's choices is
    argparse's usage error (also exit 2)."""
    root, _, _ = tiny_dir
    base = [sys.executable, "-m", "minirad", "generate", "--model", str(root / "model")]
    run = subprocess.run(
        [*base, "--prompt", "w10", "--device", "gpu"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("minirad generate: error: --device: device 'gpu' is not a")
    assert run.stderr.count("\n") == 1
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()) as err:
        main(["generate", "--prompt", "w10", "--dtype", "float16"])
    assert e.value.code == 2
    assert "argument --dtype: invalid choice: 'float16'" in err.getvalue()


def test_batch_help_describes_the_jsonl_fields_and_every_flag():
    batch = build_parser()._subparsers._group_actions[0].choices["batch"]
    text = batch.format_help()
    lines = text.splitlines()
    for field, what in JSONL_FIELDS.items():
        assert [ln for ln in lines if ln.split()[:1] == [field]] == [f"  {field:<14}  {what}"]
    assert all(a.help for a in batch._actions), [a.dest for a in batch._actions if not a.help]


def test_explain_help_states_every_default_and_how_requests_are_numbered():
    """Issue 43: ``minirad explain --help`` gave no default for --model (nor for the trace or
    --from-recording), and did not say the report numbers requests r1, r2, ... while --json
    counts "request" from 0."""
    from minirad.models import DEFAULT_MODEL_DIR

    explain = build_parser()._subparsers._group_actions[0].choices["explain"]
    text = " ".join(explain.format_help().split())
    for action in explain._actions:
        if action.dest == "help" or action.help == argparse.SUPPRESS:  # the old --policy
            continue
        help_text = " ".join(explain._get_formatter()._expand_help(action).split())
        assert "default" in help_text, (action.dest, help_text)
    model = next(a for a in explain._actions if a.dest == "model")
    assert f"default: the shipped {DEFAULT_MODEL_DIR.name}" in model.help
    assert "r1, r2, ..." in text and '"request" counts from 0' in text and '"label"' in text


def test_serve_help_says_what_a_wildcard_host_exposes_and_a_bare_port_is_loopback():
    """``--help`` suggested ``tcp://*:5557``, which publishes every prompt's token ids on
    every interface. It now says what ``*`` exposes, and a bare port binds loopback."""
    from minirad.entrypoints.commands.serve import kv_events_endpoint

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "every network interface" in text and "loopback" in text
    assert kv_events_endpoint("5557") == "tcp://127.0.0.1:5557"
    assert kv_events_endpoint("tcp://*:5557") == "tcp://*:5557"  # as written: the user chose it
    assert kv_events_endpoint(None) is None


# ---------------------------------------------------------------- structured output
# The shipped model, for its real byte-level tokenizer (a grammar spells JSON and words in
# it; the tiny test vocabulary has only "w4".."w95"). Nothing here depends on its answers being
# right: only on their being what the grammar allows.
SHAPES_IMAGE = str(
    Path(__file__).resolve().parents[1] / "data/images/red_circle_left_of_blue_square.png"
)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def shipped_engine():
    from minirad.engine import LLMEngine
    from minirad.models import DEFAULT_MODEL_DIR

    return LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)


def engine_answer(engine, prompt: str, params) -> str:
    """The engine's own answer to the CLI's request (the reference for the flags' mapping)."""
    from minirad.engine import GenerateRequest

    text = chat_prompt(engine.processor, prompt, 1)
    return engine.generate([GenerateRequest(text, [SHAPES_IMAGE], params)])[0].text


def test_generate_with_each_constraint(shipped_engine, tmp_path):
    """--json-schema, --regex and --choice are SamplingParams(json_schema=, regex=, choice=):
    the answer is the engine's constrained one, and it is what the grammar allows."""
    import jsonschema

    from minirad.course.scenes import JSON_PROMPT, SHAPES_JSON_SCHEMA
    from minirad.engine import SamplingParams

    (tmp_path / "shapes.json").write_text(json.dumps(SHAPES_JSON_SCHEMA))
    gen = ["generate", "--image", SHAPES_IMAGE, "--max-new-tokens", "120"]
    cases = [
        (["--json-schema", str(tmp_path / "shapes.json")], JSON_PROMPT, "json_schema"),
        (["--regex", "(one|two|three)"], "How many shapes are there?", "regex"),
        (["--choice", "red", "blue", "green"], "What colour is the circle?", "choice"),
    ]
    for flags, prompt, kind in cases:
        status, out, err = run_cli(gen + flags + ["--prompt", prompt])
        assert status == 0, err
        answer = out.removesuffix("\n")
        constraint = {
            "json_schema": SHAPES_JSON_SCHEMA,
            "regex": "(one|two|three)",
            "choice": ["red", "blue", "green"],
        }[kind]
        params = SamplingParams(max_new_tokens=120, **{kind: constraint})
        assert answer == engine_answer(shipped_engine, prompt, params), kind
        if kind == "json_schema":
            jsonschema.validate(json.loads(answer), SHAPES_JSON_SCHEMA)
        else:
            assert answer in {"one", "two", "three", "red", "blue", "green"}
        (note,) = finish_lines(err)
        assert note.startswith("finish_reason: stop (stop token after "), note


def test_a_json_answer_cut_at_the_limit_says_it_is_not_valid_json(tmp_path):
    from minirad.course.scenes import JSON_PROMPT, SHAPES_JSON_SCHEMA

    (tmp_path / "shapes.json").write_text(json.dumps(SHAPES_JSON_SCHEMA))
    argv = ["generate", "--image", SHAPES_IMAGE, "--prompt", JSON_PROMPT, "--max-new-tokens"]
    for stream in ([], ["--stream"]):
        status, out, err = run_cli(
            argv + ["12", "--json-schema", str(tmp_path / "shapes.json")] + stream
        )
        assert status == 0
        with pytest.raises(ValueError):
            json.loads(out)
        assert out.startswith('{"shapes": ')  # the grammar's forced opening
        assert finish_lines(err) == [
            "finish_reason: length (max_new_tokens 12 reached); the output is cut: it is not "
            "valid JSON (raise --max-new-tokens)"
        ]


def test_cut_note_says_whether_the_cut_answer_is_complete():
    from minirad.course.scenes import SHAPES_JSON_SCHEMA
    from minirad.engine import SamplingParams

    schema, choice = SamplingParams(json_schema=SHAPES_JSON_SCHEMA), SamplingParams(choice=["ab"])
    assert cut_note('{"shapes": [{"col', schema) == (
        "the output is cut: it is not valid JSON (raise --max-new-tokens)"
    )
    assert cut_note('{"shapes": []}', schema) == "the JSON is complete, only its stop token was cut"
    assert cut_note("a", choice).startswith("the output is cut: it is not one of the choices")
    assert cut_note("ab", choice) == "the choice is complete, only its stop token was cut"
    assert cut_note("a", SamplingParams(regex="ab")).endswith("only a prefix of a regex match")
    assert cut_note("a", SamplingParams()) is None


def test_a_choice_cut_at_the_limit_says_what_it_is(shipped_engine):
    """One choice, and room for exactly its canonical tokens: jump-forward forces all but the
    last, the model picks the last among the tokens that continue the word. Either the word
    is whole (only the stop token is cut) or it is not: the note says which."""
    n = len(shipped_engine.tokenizer("purple", add_special_tokens=False)["input_ids"])
    argv = ["generate", "--image", SHAPES_IMAGE, "--prompt", "What colour is the circle?"]
    status, out, err = run_cli(argv + ["--choice", "purple", "--max-new-tokens", str(n)])
    assert status == 0 and "purple".startswith(out.removesuffix("\n"))
    whole = out == "purple\n"
    assert finish_lines(err) == [
        f"finish_reason: length (max_new_tokens {n} reached); "
        + (
            "the choice is complete, only its stop token was cut"
            if whole
            else "the output is cut: it is not one of the choices (raise --max-new-tokens)"
        )
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--regex", "(ab"], "invalid regex: "),
        (["--regex", "[z-a]"], "invalid regex: "),
        (["--json-schema", "{dir}/empty.json"], "invalid json_schema: "),
    ],
)
def test_a_grammar_that_does_not_compile_is_one_line_naming_it(tmp_path, flags, message):
    # "minimum" above "maximum": valid JSON, a valid schema, but no value satisfies it.
    (tmp_path / "empty.json").write_text('{"type": "integer", "minimum": 5, "maximum": 1}')
    argv = ["generate", "--image", SHAPES_IMAGE, "--prompt", "How many shapes are there?"]
    for stream in ([], ["--stream"]):
        flags_ = [f.replace("{dir}", str(tmp_path)) for f in flags]
        status, out, err = run_cli(argv + flags_ + stream)
        assert (status, out) == (2, "")
        assert err.count("\n") == 1 and err.startswith("minirad generate: error: " + message)
        assert "Traceback" not in err


def test_batch_lines_carry_constraints(tmp_path, shipped_engine):
    import jsonschema

    from minirad.course.scenes import JSON_PROMPT, SHAPES_JSON_SCHEMA
    from minirad.engine import SamplingParams

    (tmp_path / "img.png").write_bytes(Path(SHAPES_IMAGE).read_bytes())
    rows = [
        {"prompt": JSON_PROMPT, "images": ["img.png"], "json_schema": SHAPES_JSON_SCHEMA},
        {"prompt": "What colour is the circle?", "images": ["img.png"], "choice": ["red", "blue"]},
        {"prompt": "How many shapes are there?", "images": ["img.png"], "regex": "(one|two)"},
        {"prompt": JSON_PROMPT, "images": ["img.png"], "json_schema": SHAPES_JSON_SCHEMA}
        | {"max_new_tokens": 5},
    ]
    jsonl = write_jsonl(tmp_path / "r.jsonl", rows)
    status, out, err = run_cli(["batch", str(jsonl), "--max-new-tokens", "120"])
    assert status == 0, err
    answers = [ln.split("-> ", 1)[1] for ln in out.splitlines() if "    -> " in ln]
    jsonschema.validate(json.loads(answers[0]), SHAPES_JSON_SCHEMA)
    assert answers[1] in ("red", "blue") and answers[2] in ("one", "two")
    params = SamplingParams(max_new_tokens=120, json_schema=SHAPES_JSON_SCHEMA)
    assert answers[0] == engine_answer(shipped_engine, JSON_PROMPT, params)
    notes = finish_lines(out)
    assert all(n.startswith("finish_reason: stop") for n in notes[:3]), notes
    assert notes[3].endswith("; the output is cut: it is not valid JSON (raise --max-new-tokens)")
    # A line whose grammar does not compile is named; nothing runs.
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:1] + [rows[2] | {"regex": "(one"}])
    status, out, err = run_cli(["batch", str(bad)])
    assert (status, out) == (2, "")
    assert err.startswith(f"minirad batch: error: {bad}:2: invalid regex: ")
    assert err.count("\n") == 1
