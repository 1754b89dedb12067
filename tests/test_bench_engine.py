"""Smoke test of ``python -m minirad.bench engine`` on a tiny config-built LLaVA.

Small workloads; what is checked is not speed (never asserted) but that HF ``generate()`` on
left-padded batches and our engine give the same greedy answers, that the radix cache saves
prefill work on the shared workload, and that the report renders. With ``--peer vllm`` the
real vLLM joins, on the shipped model (the ``vllm_python`` fixture: skipped without
``make vllm``, except in CI); without its venv the command says how to build it.
"""

import dataclasses
import re
import stat

import numpy as np
import pytest
import torch
from PIL import Image
from test_cli import TINY_CHAT_TEMPLATE
from tiny_models import IMAGE_SIZE, bytes_per_token, tiny_llava, tiny_llava_processor

from minirad.bench import main as bench_main
from minirad.bench.engine import (
    default_workloads,
    format_report,
    run_engine_benchmark,
    shared_workload,
    text_workload,
    unique_workload,
)
from minirad.bench.peer import kv_memory
from minirad.bench.rss import RSSPeak
from minirad.engine import EngineConfig
from minirad.errors import InvalidArgumentError, PeerError
from minirad.peers import vllm_env

MAX_NEW = 5


def make_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava():
    processor = tiny_llava_processor()
    processor.chat_template = TINY_CHAT_TEMPLATE
    return tiny_llava(), processor


@pytest.fixture(scope="module")
def results(llava):
    model, processor = llava
    # Questions of different lengths: HF's batches really are padded.
    questions = ["w10", "w11 w12 w13", "w14 w15"]
    shared = shared_workload(
        processor, [make_image(i) for i in range(2)], questions, "w20 w21 w22 w23 w24 w25"
    )
    unique = unique_workload(
        processor, [make_image(10 + i) for i in range(3)], ["w30", "w31 w32", "w33 w34 w35 w36"]
    )
    return run_engine_benchmark(
        model, processor, [shared, unique], batch_size=2, max_new_tokens=MAX_NEW
    )


def test_answers_match_hf(results):
    for r in results:
        assert len(r.hf.outputs) == len(r.workload.requests)
        assert all(len(o) == MAX_NEW for o in r.hf.outputs)  # the tiny model has no EOS
        for run in r.minirad:
            assert r.mismatches(run) == 0, run.name


def test_radix_saves_prefill_and_encoder_work_on_the_shared_workload(results):
    shared, unique = results
    radix, none = shared.minirad
    assert (radix.name, none.name) == ("minirad radix", "minirad none")
    assert radix.prefill_tokens < none.prefill_tokens
    assert radix.cached_tokens > 0 and none.cached_tokens == 0
    assert radix.prefill_tokens + radix.cached_tokens == none.prefill_tokens
    # Two images asked three questions each: HF encodes 6, the encoder cache 2 at most.
    assert shared.hf.encoder_calls == 6 and radix.encoder_calls <= 2
    # HF computes padding too: at least the unpadded prompt tokens.
    assert shared.hf.prefill_tokens >= none.prefill_tokens
    # Nothing but the template's first tokens is shared in the unique workload.
    u_radix, u_none = unique.minirad
    assert u_radix.prefill_tokens > 0.8 * u_none.prefill_tokens
    assert u_radix.encoder_calls == u_none.encoder_calls == unique.hf.encoder_calls == 3


def test_report_renders(results):
    report = format_report(results)
    assert "workload shared: 2 images x 3 questions" in report
    assert "workload unique: 3 distinct images" in report
    rows = ("output tokens/s", "prompt+output tokens/s", "TTFT mean, s", "prefill tokens")
    for row in (*rows, "prompt tokens", "encoder calls"):
        assert sum(ln.startswith(row + "  ") for ln in report.splitlines()) == 2
    mismatch_rows = [ln for ln in report.splitlines() if ln.startswith("mismatches vs HF")]
    assert [ln.split()[-3:] for ln in mismatch_rows] == [["-", "0", "0"]] * 2
    assert "(1.00x)" in report  # the HF column against itself


def report_row(report: str, name: str) -> list[list[str]]:
    """The cells of row ``name`` in each workload's table, split at the column gaps."""
    rows = [ln for ln in report.splitlines() if ln.startswith(name + "  ")]
    return [[c.strip() for c in ln[len(name) :].split("  ") if c.strip()] for ln in rows]


def test_text_workload_has_no_images_and_the_same_answers(llava):
    """Workload (c): system prompts x questions, text only; HF generate() on the LLaVA with
    no image and our engine agree, and the tree reuses each system prompt."""
    model, processor = llava
    text = text_workload(processor, ["w20 w21 w22 w23 w24 w25", "w26 w27 w28"], ["w10", "w11"])
    assert text.description == "2 system prompts x 2 questions, no images"
    assert all(images == [] and "<image>" not in t for t, images in text.requests)
    (r,) = run_engine_benchmark(model, processor, [text], batch_size=2, max_new_tokens=MAX_NEW)
    radix, none = r.minirad
    assert r.mismatches(radix) == r.mismatches(none) == 0
    assert r.hf.encoder_calls == radix.encoder_calls == 0
    assert radix.cached_tokens > 0 and radix.prefill_tokens < none.prefill_tokens


def test_default_workloads_by_name(llava):
    """``names`` picks workloads (in shared, unique, text order); the shared and unique ones of
    a seed do not change when text is asked for too."""
    _, processor = llava
    kwargs = {"num_images": 1, "num_questions": 2, "num_unique": 2, "num_system_prompts": 3}
    both = default_workloads(processor, **kwargs)
    every = default_workloads(processor, **kwargs, names=("text", "unique", "shared"))
    assert [w.name for w in both] == ["shared", "unique"]
    assert [w.name for w in every] == ["shared", "unique", "text"]
    assert [w.requests for w in every[:2]] == [w.requests for w in both]
    text = every[2]
    assert len(text.requests) == 3 * 2 and all(ims == [] for _, ims in text.requests)
    assert "The picture shows" in text.requests[0][0]  # the scene, in words
    with pytest.raises(InvalidArgumentError):
        default_workloads(processor, **kwargs, names=("pictures",))


def test_report_with_two_peers(results):
    """Each peer is a column of its own, with its own 'against' line and note."""
    r = results[0]
    vllm = dataclasses.replace(r.minirad[1], name="vLLM 0.32.0", encoder_calls=None)
    sglang = dataclasses.replace(r.minirad[1], name="SGLang 0.5.23", encoder_calls=None)
    report = format_report([dataclasses.replace(r, peers=[vllm, sglang])])
    header = next(ln for ln in report.splitlines() if "HF generate" in ln)
    assert header.split()[-4:] == ["vLLM", "0.32.0", "SGLang", "0.5.23"]
    assert report_row(report, "mismatches vs HF") == [["-", "0", "0", "0", "0"]]
    assert report_row(report, "encoder calls")[0][-2:] == ["n/a", "n/a"]
    for name in ("vLLM 0.32.0", "SGLang 0.5.23"):
        assert sum(ln.startswith(f"against {name}: minirad radix") for ln in report.splitlines())
    assert "vLLM: timed inside its worker process" in report
    assert "SGLang: the offline sglang.Engine" in report


@pytest.mark.parametrize(
    "peers", [["--peer", "vllm", "--peer", "sglang"], ["--peer", "vllm,sglang"]]
)
def test_peer_sglang_refuses_workloads_with_images_before_starting(tmp_path, capsys, peers):
    """SGLang 0.5.23 serves no LLaVA on CPU: with images in a workload the command says so
    and which workload to use, before any peer starts (no venv is looked for)."""
    for workloads in ([], ["--workload", "shared,text"]):
        with pytest.raises(SystemExit) as e:
            bench_main(["engine", "--model", str(tmp_path), *peers, *workloads])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "cannot serve LLaVA on CPU" in err and "--workload text" in err
        assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peer", "sglang,hf"], "one or more of vllm, sglang"),
        (["--workload", "pictures"], "one or more of shared, unique, text"),
        (["--peer-schedule-policy", "lpm"], "give --peer sglang"),
        (["--peer", "vllm", "--peer-schedule-policy", "lpm"], "give --peer sglang"),
        (["--peer", "sglang", "--peer-num-gpu-blocks", "9"], "give --peer vllm"),
        (["--peer", "sglang", "--peer-schedule-policy", "lmp"], "invalid choice: 'lmp'"),
        (["--peer", "vllm,sglang", "--peer-omp-threads-bind", "auto"], "a list of CPUs"),
        (["--peer", "sglang", "--peer-omp-threads-bind", "0-4096"], "this process may use"),
    ],
)
def test_peer_options_are_checked(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench_main(["engine", "--model", str(tmp_path), "--workload", "text", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_kv_memory_of_every_run(llava, results):
    model, _ = llava
    pool = EngineConfig().num_kv_slots
    for r in results:
        assert r.hf.kv is None  # HF grows a cache per batch: no pool
        longest = max(len(p) for p in r.hf.prompt_token_ids)
        for run in r.minirad:
            kv = run.kv
            assert kv.bytes_per_token == bytes_per_token(model)
            assert (kv.pool_tokens, kv.pool_bytes) == (pool, pool * kv.bytes_per_token)
            # A request holds its whole prompt while it decodes (no stop token here).
            assert longest <= kv.peak_usage <= kv.peak_held <= kv.pool_tokens
        radix, none = r.minirad
        # The tree keeps finished prefixes allocated; "none" frees them at once.
        assert radix.kv.peak_held > radix.kv.peak_usage
    report = format_report(results)
    for row, cell in (
        ("KV bytes/token", lambda kv: str(kv.bytes_per_token)),
        ("KV pool, tokens", lambda kv: str(kv.pool_tokens)),
        ("peak KV usage, tokens", lambda kv: kv.percent(kv.peak_usage, kv.pool_tokens)),
        ("peak KV held, tokens", lambda kv: kv.percent(kv.peak_held, kv.pool_tokens)),
    ):
        want = [["n/a"] + [cell(x.kv) for x in r.minirad] for r in results]
        assert report_row(report, row) == want, row


def test_peak_rss_of_every_run(results):
    """HF and minirad run in this process: each run's peak of its resident memory (weights
    included), reset before the run, in the report's RSS rows."""
    for r in results:
        for run in r.runs:
            assert run.rss is not None and 0 < run.rss.start <= run.rss.peak, run.name
    report = format_report(results)
    for row, field in (("peak RSS, MiB", "peak"), ("  at run start, MiB", "start")):
        want = [[f"{getattr(x.rss, field) / 2**20:.0f}" for x in r.runs] for r in results]
        assert report_row(report, row) == want, row
    assert "RSS: resident memory of the processes that run the system" in report


def test_peak_rss_row_says_na_where_not_measured(results):
    hf = results[0].hf
    unmeasured = dataclasses.replace(
        results[0], hf=dataclasses.replace(hf, rss=RSSPeak(start=None, peak=None))
    )
    cells = report_row(format_report([unmeasured]), "peak RSS, MiB")[0]
    assert cells[0] == "n/a" and all(c != "n/a" for c in cells[1:])


def test_kv_memory_of_vllm_rejects_tensors_that_are_not_its_blocks():
    info = {"num_gpu_blocks": 4, "block_size": 32}
    good = {"shape": [4, 2, 32, 64], "element_size": 4}
    assert kv_memory({**info, "kv_cache_tensors": [good]}, None).bytes_per_token == 2 * 64 * 4
    for tensors in ([], [{**good, "shape": [5, 2, 32, 64]}], [{**good, "shape": [4, 2, 31]}]):
        with pytest.raises(PeerError):
            kv_memory({**info, "kv_cache_tensors": tensors}, None)


def test_unique_workload_rejects_shared_questions(llava):
    _, processor = llava
    with pytest.raises(InvalidArgumentError):
        unique_workload(processor, [make_image(1), make_image(2)], ["w10", "w10"])


def test_command_line_on_a_saved_model(llava, tmp_path, capsys):
    """The ``engine`` subcommand end to end, on scenes from :mod:`minirad.course.scenes` (their
    English words are unknown to the tiny tokenizer, which is fine for a smoke run)."""
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    argv = ["engine", "--model", str(tmp_path), "--images", "1", "--questions", "2"]
    assert bench_main(argv + ["--unique", "2", "--batch-size", "2", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "workload shared: 1 images x 2 questions" in out and "workload unique" in out
    with pytest.raises(SystemExit) as e:
        bench_main(["engine", "--model", str(tmp_path / "nowhere")])
    assert e.value.code == 2


def test_command_line_in_bf16_without_prepacked_weights(llava, tmp_path, capsys):
    """``--dtype bfloat16``: HF and minirad both load the model in bf16 and the report says
    so; answers that differ at bf16 near-ties are counted, not a failure."""
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    argv = ["engine", "--model", str(tmp_path), "--images", "1", "--questions", "2"]
    argv += ["--unique", "2", "--batch-size", "2", "--max-new-tokens", "3", "--repeat", "1"]
    assert bench_main(argv + ["--dtype", "bfloat16", "--no-prepack-weights"]) == 0
    out = capsys.readouterr().out
    assert "fastest of 1 runs, in bfloat16; minirad without prepacked weights." in out
    kv_row = next(ln for ln in out.splitlines() if ln.startswith("KV bytes/token"))
    assert kv_row.split()[-1] == str(bytes_per_token(model) // 2)  # bf16 KV, model in fp32


def test_command_line_refuses_a_device_it_cannot_use(llava, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as e:
        bench_main(["engine", "--model", str(tmp_path), "--device", "cuda"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'cuda' is not available" in err and "Traceback" not in err


def test_prompt_tokens_are_counted_without_padding(results):
    for r in results:
        none = r.minirad[1]
        assert none.prefill_tokens == none.prompt_tokens  # no reuse: every prompt token
        assert [len(p) for p in r.hf.prompt_token_ids] == [len(p) for p in none.prompt_token_ids]
        assert r.hf.prompt_token_ids == none.prompt_token_ids
        radix = r.minirad[0]
        assert sum(radix.num_cached_tokens) == radix.cached_tokens


def test_peer_vllm_without_its_venv_says_how_to_build_it(llava, tmp_path, capsys, monkeypatch):
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    monkeypatch.setattr(vllm_env, "VLLM_VENV", tmp_path / "no-venv")
    with pytest.raises(SystemExit) as e:
        bench_main(["engine", "--model", str(tmp_path), "--peer", "vllm"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "make vllm" in err and "Traceback" not in err


def fake_vllm_venv(path, record):
    """A vLLM venv whose Python records the worker's VLLM_CPU_OMP_THREADS_BIND and exits."""
    python = path / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        f'#!/bin/sh\necho "${{VLLM_CPU_OMP_THREADS_BIND-unset}}" > {record}\nexit 1\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    (path / ".installed").touch()
    return path


@pytest.mark.parametrize(
    ("option", "seen"), [(["--peer-omp-threads-bind", "0-1"], "0-1"), ([], "unset")]
)
def test_peer_omp_threads_bind_reaches_the_worker(
    llava, tmp_path, capsys, monkeypatch, option, seen
):
    """``--peer-omp-threads-bind`` becomes the worker's VLLM_CPU_OMP_THREADS_BIND; without it
    the worker inherits this environment (here: unset, vLLM's ``auto``)."""
    record = tmp_path / "bind"
    monkeypatch.setattr(vllm_env, "VLLM_VENV", fake_vllm_venv(tmp_path / "venv", record))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with pytest.raises(SystemExit) as e:
        bench_main(["engine", "--model", str(tmp_path), "--peer", "vllm", *option])
    assert e.value.code == 2
    assert "vLLM worker exited" in capsys.readouterr().err
    assert record.read_text().strip() == seen


def test_peer_omp_threads_bind_needs_a_peer(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["engine", "--model", str(tmp_path), "--peer-omp-threads-bind", "0-1"])
    assert e.value.code == 2
    assert "give --peer" in capsys.readouterr().err


def test_peer_vllm_end_to_end(vllm_python, capsys):
    """The real vLLM as a third column, on the shipped model: same answers, threads shown;
    its pool capped to minirad's (4096 tokens in blocks of 32, and vLLM's null block)."""
    argv = ["engine", "--peer", "vllm", "--images", "1", "--questions", "3", "--unique", "2"]
    argv += ["--num-kv-slots", "4096", "--peer-num-gpu-blocks", str(4096 // 32 + 1)]
    assert bench_main(argv + ["--max-new-tokens", "8", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(ln for ln in lines if "HF generate" in ln)
    assert header.split()[-2:] == ["vLLM", "0.32.0"]
    mismatch_rows = [ln for ln in lines if ln.startswith("mismatches vs HF")]
    assert [ln.split()[-4:] for ln in mismatch_rows] == [["-", "0", "0", "0"]] * 2
    cached = next(ln for ln in lines if ln.startswith("cached tokens"))
    assert int(cached.split()[-1]) > 0  # vLLM hit the shared system prompt and image
    encoder = next(ln for ln in lines if ln.startswith("encoder calls"))
    assert encoder.split()[-1] == "n/a"
    assert sum(ln.startswith("against vLLM 0.32.0: minirad radix") for ln in lines) == 2
    assert "VLLM::Worker" in out and "OMP_NUM_THREADS=" in out  # vLLM's thread binding
    assert "HF and minirad (this process): torch 1 intra-op" in out
    # KV memory: vLLM's own tensors hold what ours hold per token (same model, float32).
    for per_token in report_row(out, "KV bytes/token"):
        assert per_token[0] == "n/a" and per_token[1] == per_token[2] == per_token[3]
    assert re.findall(r"vLLM 0\.32\.0: (\d+) blocks of 32 tokens", out) == [str(4096 // 32 + 1)]
    assert report_row(out, "KV pool, tokens") == [["n/a", "4096", "4096", "4096"]] * 2
    for mib in report_row(out, "KV pool, MiB"):  # vLLM's tensors hold its null block too
        assert mib[3] == f"{float(mib[1]) * (4096 // 32 + 1) / (4096 // 32):.2f}"
    usages = report_row(out, "peak KV usage, tokens")
    for usage, held in zip(usages, report_row(out, "peak KV held, tokens"), strict=True):
        tokens = int(usage[3].split()[0])
        assert 0 < tokens <= 4096 and tokens % 32 == 0  # sampled, in whole blocks
        assert held[3] == "n/a"
    # RSS: vLLM's processes together hold at least a Python with torch each; the worker's
    # per-process lines give each one's.
    for peak, start in zip(
        report_row(out, "peak RSS, MiB"), report_row(out, "  at run start, MiB"), strict=True
    ):
        assert all(0 < int(s) <= int(p) for p, s in zip(peak, start, strict=True))
        assert int(start[3]) > int(start[0])  # three processes against one
    assert re.search(r"VLLM::Worker \(pid \d+\): .*, RSS \d+ MiB", out)
