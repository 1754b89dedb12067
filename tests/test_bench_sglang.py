"""The real SGLang as a column of ``python -m minirad.bench engine`` (``--peer sglang``).

One end-to-end run on the shipped model's text half, a tiny text workload (the
``sglang_python`` fixture: skipped without ``make sglang``, except in CI): the same greedy
tokens as HF, its cached tokens, its pool, its processes pinned, and no SGLang process left
after it. The rest needs no SGLang: the pool's arithmetic, the threads section, the message
without the venv.
"""

import os
import re

import pytest
from test_bench_engine import report_row

from minirad.bench import main as bench_main
from minirad.bench.sglang_peer import describe_threads, kv_memory, text_model_for
from minirad.bench.worker_common import descendants
from minirad.errors import InvalidArgumentError, PeerError
from minirad.peers import sglang_env
from minirad.peers.server_process import usable_cpus
from minirad.peers.text_model import DEFAULT_LLAVA_DIR, DEFAULT_TEXT_MODEL_DIR

INFO = {
    "sglang_version": "0.5.23",
    "token_capacity": 4096,
    "kv_cache_gb": 0.006,
    "kv_bytes_per_token": 1536,
    "page_size": 1,
    "max_running_requests": 8,
    "chunked_prefill_size": 4096,
    "schedule_policy": "fcfs",
    "overlap_schedule": True,
    "attention_backend": "torch_native",
    "radix_eviction_policy": "lru",
    "dtype": "float32",
    "sleep_on_idle": True,
    "omp_threads_bind": None,
    "omp_num_threads": "1",
    "processes": [
        {"pid": 10, "name": "python", "threads": 11, "cpus": {"0-1": 11}, "env": {}, "rss": 2**29},
        {
            "pid": 12,
            "name": "sglang::schedul",
            "threads": 34,
            "cpus": {"0-1": 34},
            "env": {"OMP_NUM_THREADS": "1"},
            "rss": None,
        },
    ],
}


def test_kv_memory_of_sglang():
    """Its pool: the usable tokens, and K and V buffers one page longer (its padding slot),
    checked against the size SGLang reports."""
    kv = kv_memory(INFO)
    assert (kv.bytes_per_token, kv.pool_tokens, kv.block_size) == (1536, 4096, 1)
    assert kv.pool_bytes == 4097 * 1536
    assert kv.peak_usage is None and kv.peak_held is None
    with pytest.raises(PeerError, match="not the"):
        kv_memory({**INFO, "kv_cache_gb": 0.012})  # a pool laid out otherwise


def test_threads_section_of_sglang():
    text = describe_threads(INFO)
    first, *procs = text.splitlines()
    assert "4096 tokens in pages of 1, max_running_requests 8, schedule_policy fcfs" in first
    assert "CPUs unpinned, OMP_NUM_THREADS=1" in first
    assert (
        procs[0] == "  python (pid 10, tokenizer manager): 11 threads, 11 on cpus 0-1, RSS 512 MiB"
    )
    assert procs[1] == "  sglang::schedul (pid 12): 34 threads, 34 on cpus 0-1 OMP_NUM_THREADS=1"


def test_sglang_loads_the_llava_text_half(tmp_path):
    assert text_model_for(DEFAULT_LLAVA_DIR) == DEFAULT_TEXT_MODEL_DIR
    assert text_model_for(DEFAULT_TEXT_MODEL_DIR) == DEFAULT_TEXT_MODEL_DIR  # a text model
    with pytest.raises(InvalidArgumentError):
        text_model_for(tmp_path)  # no config.json


def test_peer_sglang_without_its_venv_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sglang_env, "SGLANG_VENV", tmp_path / "no-venv")
    with pytest.raises(SystemExit) as e:
        bench_main(["engine", "--workload", "text", "--peer", "sglang"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "make sglang" in err and "Traceback" not in err


def sglang_processes() -> list[int]:
    """This process's descendants that are SGLang's (its scheduler, its detokenizer)."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().startswith("sglang::"):
                    found.append(pid)
        except OSError:
            continue
    return found


def test_peer_sglang_end_to_end(sglang_python, capsys):
    """The real SGLang as a column on the text workload (2 system prompts x 3 questions, 2
    requests in flight, so that later requests find the system prompt cached): the same
    greedy tokens as HF, the same prompt tokens, its cached tokens, our pool's size and bytes
    per token, its scheduler pinned to the core asked for; one SGLang start, stopped after."""
    before = set(sglang_processes())  # another test's server may share this worker
    cpu = usable_cpus()[-1]
    argv = ["engine", "--workload", "text", "--system-prompts", "2", "--questions", "3"]
    argv += ["--batch-size", "2", "--max-new-tokens", "8", "--repeat", "1"]
    argv += ["--peer", "sglang", "--peer-omp-threads-bind", str(cpu)]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if "HF generate" in ln)
    assert header.split()[-2:] == ["SGLang", "0.5.23"]
    assert report_row(out, "mismatches vs HF") == [["-", "0", "0", "0"]]
    (prompt,) = report_row(out, "prompt tokens")
    assert len(set(prompt)) == 1  # SGLang tokenized the prompts as HF did
    (cached,) = report_row(out, "cached tokens")
    assert int(cached[3]) > 0  # the system prompts, reused
    assert report_row(out, "encoder calls")[0][3] == "n/a"
    assert report_row(out, "KV bytes/token") == [["n/a", "1536", "1536", "1536"]]
    assert report_row(out, "KV pool, tokens") == [["n/a", "4096", "4096", "4096"]]
    assert report_row(out, "peak KV usage, tokens")[0][3] == "n/a"
    peak, start = report_row(out, "peak RSS, MiB")[0], report_row(out, "  at run start, MiB")[0]
    assert 0 < int(start[3]) <= int(peak[3]) and int(start[3]) > int(start[0])  # 3 processes
    assert "against SGLang 0.5.23: minirad radix" in out
    assert "SGLang: the offline sglang.Engine" in out
    # Pinned: every SGLang process on the core asked for, its scheduler with one OpenMP thread.
    assert f"CPUs {cpu}, OMP_NUM_THREADS=1; its processes:" in out
    assert re.search(rf"sglang::schedul \(pid \d+\): (\d+) threads, \1 on cpus {cpu} ", out)
    assert "OMP_NUM_THREADS=1, RSS" in out
    assert set(sglang_processes()) <= before  # its own stopped with the run
