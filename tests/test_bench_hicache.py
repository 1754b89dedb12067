"""The hicache benchmark (``python -m minirad.bench hicache``) on a tiny chat trace."""

from __future__ import annotations

import pytest

from minirad.bench import main
from minirad.bench.hicache import replay_tiers, run_hicache_benchmark
from minirad.bench.radix import capacity_for_fraction, replay
from minirad.bench.trace import make_chat_trace


@pytest.fixture(scope="module")
def trace():
    return make_chat_trace(30, 3, seed=1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiers_hit_at_least_device_only_and_at_most_min(trace, page_size):
    cap = capacity_for_fraction(trace, 0.1, page_size)
    runs, mins = run_hicache_benchmark(trace, cap, page_size, (1.0, 2.0, 4.0), disk_ratio=None)
    device, *tiers = runs
    # Device-only is radix.py's replay with LRU: the same lifecycle, the same hits.
    assert device.hit_tokens == replay(trace, cap, page_size, "lru").hit_tokens
    assert device.host_hit_tokens == 0 and device.host_capacity == 0
    assert [t.host_capacity for t in tiers] == [cap, 2 * cap, 4 * cap]
    for r in runs:
        assert r.hit_tokens + r.prefill_tokens == trace.prompt_tokens
        assert r.hit_tokens <= mins[r.total_capacity].bound_hit_tokens
    for t in tiers:
        assert t.hit_tokens >= device.hit_tokens
    assert tiers[-1].host_hit_tokens > 0  # the host tier does load back on this trace


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_other_write_policies_run(trace, policy):
    cap = capacity_for_fraction(trace, 0.1)
    run = replay_tiers(trace, cap, 1, 2.0, policy)
    assert 0 <= run.host_hit_tokens <= run.hit_tokens <= trace.prompt_tokens


def test_cli(capsys):
    args = ["hicache", "--conversations", "20", "--turns", "2", "--ratios", "1", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "device only" in out and "host x2" in out
    assert "MIN (Belady, one flat pool of" in out and "device only" in out


def test_the_disk_row_reads_pages_back_and_stays_under_min(trace):
    cap = capacity_for_fraction(trace, 0.1)
    runs, mins = run_hicache_benchmark(trace, cap, 1, (0.5,), disk_ratio=0.5)
    host, disk = runs[1], runs[2]  # a host too small for this trace: the disk helps
    assert disk.disk and disk.label == "host x0.5 + disk"
    assert 0 < disk.storage_hit_tokens <= disk.host_hit_tokens
    assert disk.hit_tokens >= host.hit_tokens  # the disk only adds pages to read back
    assert disk.hit_tokens <= max(o.bound_hit_tokens for o in mins.values())


def test_engine_bench_answers_match_and_the_tiers_serve_the_later_turns(capsys):
    args = ["hicache-engine", "--conversations", "3", "--turns", "2", "--repeat", "1"]
    args += ["--max-new-tokens", "4"]
    assert main(args) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        for label in ("device only", "+ host x4", "+ host x2 + disk, new engine"):
            if line.startswith(label):
                cells = line[len(label) :].split()
                rows[label] = cells
    assert len(rows) == 3
    assert all(cells[-1] == "0" for cells in rows.values())  # no mismatching answer
    host = rows["+ host x4"]  # ... prefill, device / host / disk, mismatch
    assert int(host[-4].replace(",", "")) > 0  # tokens from the host
    disk = rows["+ host x2 + disk, new engine"]
    assert int(disk[-2].replace(",", "")) > 0  # a new engine found pages on disk
