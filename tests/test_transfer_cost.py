"""The load-back vs recompute cost model (:mod:`minirad.kvcache.transfer_cost`) and its
benchmark (``python -m minirad.bench transfer-cost``) on the shipped model.

The arithmetic is checked against its definitions (load = latency + bytes / bandwidth,
recompute = tokens / rate, and at the break-even length the two are equal), never against
figures measured here; the command line runs with one try and no timing is asserted.
"""

from __future__ import annotations

import math

import pytest

from minirad.bench import main as bench_main
from minirad.errors import InvalidArgumentError
from minirad.kvcache.transfer_cost import (
    PRESETS,
    TierLink,
    break_even_tokens,
    kv_bytes_per_token,
    load_time_s,
    recompute_time_s,
)

LINK = TierLink("test", bandwidth_gb_s=2.0, latency_us=50.0)


def test_bytes_per_token_is_k_and_v_in_every_layer():
    # 30 layers, 3 KV heads of 64, fp32: llava-200m's KV.
    assert kv_bytes_per_token(30, 3, 64, 4) == 30 * (3 * 64 * 4) * 2 == 46080


def test_load_time_is_latency_plus_bytes_over_bandwidth():
    n, bpt = 1000, 4096
    expected = 50e-6 + n * bpt / 2e9
    assert load_time_s(n, bpt, LINK) == pytest.approx(expected)
    # each extra transfer adds one latency and no bytes
    assert load_time_s(n, bpt, LINK, transfers=4) - load_time_s(n, bpt, LINK) == pytest.approx(
        3 * 50e-6
    )
    assert load_time_s(0, bpt, LINK) == 0.0  # nothing to load, no transfer


def test_recompute_time_is_linear():
    assert recompute_time_s(500, 1000.0) == pytest.approx(0.5)
    assert recompute_time_s(1000, 1000.0) == pytest.approx(2 * recompute_time_s(500, 1000.0))


@pytest.mark.parametrize("transfers", [1, 8])
def test_break_even_is_where_the_two_lines_cross(transfers):
    bpt, rate = 4096, 100_000.0  # 10 us per token recomputed, 2.048 us per token loaded
    n_star = break_even_tokens(bpt, LINK, rate, transfers)
    derived = transfers * LINK.latency_s / (1 / rate - bpt / (LINK.bandwidth_gb_s * 1e9))
    assert n_star == pytest.approx(derived)
    # below it recomputing wins, above it loading back does
    below, above = math.floor(n_star), math.ceil(n_star) + 1
    assert load_time_s(below, bpt, LINK, transfers) > recompute_time_s(below, rate)
    assert load_time_s(above, bpt, LINK, transfers) < recompute_time_s(above, rate)
    # at the crossing the continuous lines meet
    at = transfers * LINK.latency_s + n_star * bpt / 2e9
    assert at == pytest.approx(n_star / rate)


def test_a_link_slower_per_token_than_recompute_never_pays():
    bpt = 4096
    per_token_load = bpt / (LINK.bandwidth_gb_s * 1e9)
    assert break_even_tokens(bpt, LINK, 1 / per_token_load) is None  # equal per token
    assert break_even_tokens(bpt, LINK, 2 / per_token_load) is None  # recompute faster
    for n in (1, 1000, 10**7):
        assert load_time_s(n, bpt, LINK) > recompute_time_s(n, 2 / per_token_load)


def test_no_latency_pays_from_the_first_token():
    assert break_even_tokens(4096, TierLink("ideal", 10.0, 0.0), 1000.0) == 0.0


def test_faster_links_break_even_sooner():
    bpt, rate = 46080, 20_000.0
    pcie4, pcie5 = PRESETS["pcie4-x16"], PRESETS["pcie5-x16"]
    assert pcie5.bandwidth_gb_s > pcie4.bandwidth_gb_s and pcie5.latency_us == pcie4.latency_us
    assert break_even_tokens(bpt, pcie5, rate) < break_even_tokens(bpt, pcie4, rate)


def test_presets_say_where_their_figures_come_from():
    for name, link in PRESETS.items():
        assert link.name == name
        assert link.source  # "typical, not measured" or a reference
        assert "measured here" not in link.source  # measuring is the benchmark's job


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TierLink("x", 0, 1), "bandwidth_gb_s"),
        (lambda: TierLink("x", float("inf"), 1), "bandwidth_gb_s"),
        (lambda: TierLink("x", 1, -1), "latency_us"),
        (lambda: TierLink("x", 1, float("nan")), "latency_us"),
        (lambda: TierLink("", 1, 1), "name"),
        (lambda: load_time_s(-1, 8, LINK), "n_tokens"),
        (lambda: load_time_s(1.5, 8, LINK), "n_tokens"),
        (lambda: load_time_s(1, 0, LINK), "bytes_per_token"),
        (lambda: load_time_s(1, 8, LINK, transfers=0), "transfers"),
        (lambda: load_time_s(1, 8, "pcie"), "TierLink"),
        (lambda: recompute_time_s(10, 0), "prefill_tokens_per_s"),
        (lambda: recompute_time_s(True, 1.0), "n_tokens"),
        (lambda: break_even_tokens(8, LINK, -5.0), "prefill_tokens_per_s"),
        (lambda: break_even_tokens(8, None, 5.0), "TierLink"),
        (lambda: kv_bytes_per_token(0, 1, 1, 1), "num_layers"),
    ],
)
def test_bad_arguments_are_refused(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_command_line_prints_every_link(capsys):
    argv = ["transfer-cost", "--repeats", "1", "--prompt-tokens", "32", "--copy-tokens", "64"]
    assert bench_main([*argv, "--small-copies", "2", "--lengths", "16", "1024"]) == 0
    out = capsys.readouterr().out
    # the shipped model: 3 layers x 2 x 2 KV heads x 32 x fp32
    assert f"= {kv_bytes_per_token(3, 2, 32, 4)} B per token" in out
    assert "32-token prompt" in out
    for name in ["recompute", "host-copy", *PRESETS]:
        assert f"\n  {name} " in out
    assert "measured here" in out and "typical, not measured" in out


def test_command_line_takes_one_link_and_a_rate(capsys):
    argv = ["transfer-cost", "--repeats", "1", "--copy-tokens", "64", "--small-copies", "2"]
    # 1536 B per token at 1 GB/s is 1.536 us per token: slower than 1e6 tokens/s recompute
    argv += ["--bandwidth-gb-s", "1", "--latency-us", "5", "--prefill-tokens-per-s", "1e6"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "given, not measured" in out
    assert "\n  given " in out and "never" in out
    assert "nvme-gen4" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nowhere"], "not found"),
        (["--prompt-tokens", "512"], "context"),
        (["--bandwidth-gb-s", "0"], "bandwidth_gb_s"),
        (["--latency-us", "3"], "--bandwidth-gb-s"),
        (["--prefill-tokens-per-s", "-1"], "--prefill-tokens-per-s"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_command_lines_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["transfer-cost", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
