"""``python -m minirad.bench decode`` on the shipped model: it runs, its three variants agree
(checked inside, or it raises), and bad arguments are refused in one line."""

import pytest

from minirad.bench import main as bench_main
from minirad.bench.decode import VARIANTS, decode_slots


def test_decode_slots_share_exactly_the_prefix():
    rows = decode_slots(3, 4, 2)
    assert [r[:4] for r in rows] == [[0, 1, 2, 3]] * 3
    own = [r[4:] for r in rows]
    assert own == [[4, 5], [6, 7], [8, 9]]  # no slot in two rows past the prefix


def test_command_line_prints_every_variant(capsys):
    argv = ["decode", "--shared", "300", "--own", "4", "--steps", "1", "--rounds", "1"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "8 requests, 300 shared + 4 own context tokens" in out
    assert "0 of the decoder's 21 weight matrices" in out  # the shipped model packs none
    for name in VARIANTS:
        assert f"  {name} " in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nowhere"], "not found"),
        (["--shared", "600"], "longer than the model's"),
        (["--own", "0"], "--own"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["decode", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
