"""``python -m minirad.bench structured`` small: 3 fresh scenes on the shipped model (its real
byte-level tokenizer is what a JSON grammar needs; the tiny test vocabulary has only words).

Nothing here depends on the model's answers being right (exact match is printed, never
asserted), nor on timings: what is checked is that constrained answers validate, that the
counts the report prints add up (every computed token is a prompt, forced or sampled token;
every sampled constrained token went through one masked row), that jump-forward takes fewer
steps for the same text, and that our constrained answers equal HF's with the same grammar.
"""

import json

import jsonschema
import pytest

from minirad.bench import main as bench_main
from minirad.bench.structured import (
    FREE,
    GRAMMAR,
    HF,
    JUMP,
    format_report,
    json_workload,
    run_structured_benchmark,
    vllm_schema,
)
from minirad.course.scenes import SHAPES_JSON_SCHEMA, shapes_json
from minirad.engine.grammar import JSON_DEFAULTS
from minirad.models import DEFAULT_MODEL_DIR, load_model
from minirad.peers import vllm_env

NUM_SCENES = 3


@pytest.fixture(scope="module")
def shipped():
    return load_model(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def result(shipped):
    model, processor = shipped
    return run_structured_benchmark(
        model, processor, NUM_SCENES, batch_size=2, max_new_tokens=128, repeat=1
    )


def test_runs_and_references(result, shipped):
    _, processor = shipped
    assert [r.name for r in result.runs] == [FREE, GRAMMAR, JUMP, HF]
    _, scenes = json_workload(processor, NUM_SCENES)
    assert result.references == [shapes_json(s) for s in scenes]
    for run in result.runs:
        assert len(run.texts) == len(run.token_ids) == NUM_SCENES
        assert run.constrained == (run.name != FREE)


def test_constrained_answers_validate(result):
    for run in result.runs:
        if not run.constrained:
            continue
        assert result.validates(run) == result.parses(run) == NUM_SCENES, run.name
        for text in run.texts:
            jsonschema.validate(json.loads(text), SHAPES_JSON_SCHEMA)
            # Compact, as json.dumps writes it: the grammar allows no other whitespace.
            assert text == json.dumps(json.loads(text))
        assert all(t[-1] == 2 for t in run.token_ids)  # each ended on <|im_end|>


def test_every_computed_token_is_a_prompt_forced_or_sampled_one(result):
    """In our engine each request computes its prompt and every output token but the last
    (whose KV nobody needs): prefill + decode + cached = prompt + output - requests, with
    forced tokens computed in prefill chunks, sampled ones in decode steps or chunk ends."""
    for name in (FREE, GRAMMAR, JUMP):
        run = result.run(name)
        computed = run.prefill_tokens + run.decode_tokens + run.cached_tokens
        assert computed == run.prompt_tokens + run.output_tokens - NUM_SCENES, name
        assert run.sampled_tokens + run.forced_tokens == run.output_tokens
    grammar, jump = result.run(GRAMMAR), result.run(JUMP)
    assert grammar.forced_tokens == 0 and jump.forced_tokens > 0
    # One masked row per sampled token of a constrained answer, in our engine and in HF.
    for run in (grammar, jump, result.run(HF)):
        assert run.masked_rows == run.sampled_tokens, run.name
        assert run.mask_seconds > 0
    # Without jump-forward every output token but the prefill's first is decoded.
    assert grammar.decode_tokens == grammar.output_tokens - NUM_SCENES


def test_jump_forward_takes_fewer_steps_for_the_same_text(result):
    grammar, jump = result.run(GRAMMAR), result.run(JUMP)
    assert jump.texts == grammar.texts
    assert jump.num_steps < grammar.num_steps
    assert jump.decode_tokens < grammar.decode_tokens


def test_constrained_answers_equal_hf_with_the_same_grammar(result):
    hf, grammar = result.run(HF), result.run(GRAMMAR)
    assert hf.token_ids == grammar.token_ids
    assert result.same_text(grammar, hf) == NUM_SCENES


def test_report_renders(result):
    report = format_report(result)
    lines = report.splitlines()
    assert lines[0].startswith(f"workload json: {NUM_SCENES} fresh scenes")
    assert lines[1].split() == ["free", "grammar", "grammar", "+", "jf", "HF", "+", "grammar"]

    def row(name: str) -> list[str]:
        (line,) = [ln for ln in lines if ln.startswith(name + "  ")]
        return [c.strip() for c in line[len(name) :].split("  ") if c.strip()]

    runs = result.runs
    assert row("engine steps") == [str(r.num_steps) for r in runs]
    assert row("  forced (jump-forward)") == [str(r.forced_tokens) for r in runs]
    assert row("  vs free")[0] == "1.00x" and row("  vs grammar")[1] == "1.00x"
    assert row("valid against schema")[1:] == [f"{NUM_SCENES}/{NUM_SCENES} (100%)"] * 3
    assert row("mask, us/row")[0] == "n/a"


def test_vllm_schema_carries_our_separators():
    schema = vllm_schema(SHAPES_JSON_SCHEMA)
    assert schema["x-guidance"] == JSON_DEFAULTS
    assert {k: v for k, v in schema.items() if k != "x-guidance"} == SHAPES_JSON_SCHEMA
    own = vllm_schema({"type": "object", "x-guidance": {"item_separator": ","}})
    assert own["x-guidance"] == {**JSON_DEFAULTS, "item_separator": ","}


def test_command_line(capsys):
    argv = ["structured", "--scenes", "1", "--repeat", "1", "--no-hf", "--max-new-tokens", "96"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "workload json: 1 fresh scenes" in out and "HF + grammar" not in out
    assert "Each system's fastest of 1 runs." in out
    with pytest.raises(SystemExit) as e:
        bench_main(["structured", "--model", "/nowhere"])
    assert e.value.code == 2


def test_peer_vllm_without_its_venv_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vllm_env, "VLLM_VENV", tmp_path / "no-venv")
    with pytest.raises(SystemExit) as e:
        bench_main(["structured", "--peer", "vllm"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "make vllm" in err and "Traceback" not in err


def test_vllm_guidance_end_to_end(vllm_python, shipped):
    """The real vLLM's structured outputs on llguidance, our separators given through the
    schema's x-guidance key: valid answers, the same text as our engine's without
    jump-forward (and, free, the same as ours free). One vLLM start."""
    from minirad.bench.peer import VLLMPeer

    model, processor = shipped
    with VLLMPeer(
        DEFAULT_MODEL_DIR, max_num_seqs=2, structured_outputs_backend="guidance", python=vllm_python
    ) as peer:
        result = run_structured_benchmark(
            model, processor, 2, batch_size=2, max_new_tokens=128, repeat=1, peer=peer, hf=False
        )
    assert [r.name for r in result.runs] == [FREE, GRAMMAR, JUMP, "vLLM free", "vLLM guidance"]
    guided = result.run("vLLM guidance")
    assert result.validates(guided) == 2
    assert guided.texts == result.run(GRAMMAR).texts
    assert result.run("vLLM free").texts == result.run(FREE).texts
    assert guided.forced_tokens == 0 and guided.num_steps is None
    assert "vLLM: timed inside its worker" in format_report(result)
