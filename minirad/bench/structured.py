"""Structured-output benchmark: the JSON task with and without a grammar, with and without
jump-forward, against HF ``generate()`` with the same grammar and, with ``--peer vllm``, the
real vLLM's structured outputs on the same backend (llguidance).

Fresh scenes asked :data:`~minirad.course.scenes.JSON_PROMPT`, greedy; the runs take turns within
one invocation. The five runs and what each row measures: docs/benchmarks.md, "Structured
output".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import jsonschema
import torch
import transformers

from minirad.bench.common import Workload
from minirad.course.scenes import (
    DEFAULT_IMAGE_SIZE,
    JSON_PROMPT,
    SHAPES_JSON_SCHEMA,
    random_scene,
    render,
    shapes_json,
)
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.engine.grammar import JSON_DEFAULTS, GrammarCompiler, GrammarLogitsProcessor
from minirad.entrypoints.argtypes import positive_int, thread_count
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.errors import InvalidArgumentError
from minirad.models import DEFAULT_MODEL_DIR, load_model

if TYPE_CHECKING:
    from minirad.bench.peer import VLLMPeer

__all__ = [
    "DEFAULT_SEED",
    "StructuredResult",
    "StructuredRun",
    "add_arguments",
    "format_report",
    "json_workload",
    "run_cli",
    "run_hf_grammar",
    "run_minirad",
    "run_structured_benchmark",
    "run_vllm",
    "vllm_schema",
]

# Scenes that neither training (seed 0 + step) nor minirad.course.train's held-out check
# (EVAL_SEED = 1_000_003) draws: a stream of their own.
DEFAULT_SEED = 2_000_003


def json_workload(processor, num_scenes: int, seed: int = DEFAULT_SEED) -> tuple[Workload, list]:
    """``num_scenes`` fresh scenes from ``random.Random(seed)``, each asked ``JSON_PROMPT``
    (one image, the chat template, no system turn): the workload and the scenes.

    Raises:
        RequestError: the processor has no chat template.
    """
    rng = random.Random(seed)
    scenes = [random_scene(rng, DEFAULT_IMAGE_SIZE) for _ in range(num_scenes)]
    prompt = chat_prompt(processor, JSON_PROMPT, 1)
    requests = [(prompt, [render(s)]) for s in scenes]
    return Workload("json", f"{num_scenes} fresh scenes, {JSON_PROMPT!r}", requests), scenes


@dataclass
class StructuredRun:
    """One system's run of the workload (None: the system does not report that number).

    Attributes:
        name: the column's name.
        constrained: whether the answers were under the grammar.
        token_ids: each answer's generated ids, through its stop token.
        texts: each answer decoded, special tokens skipped.
        seconds: wall time of the run.
        prompt_tokens: prompt tokens of all requests, as the model saw them (no padding).
        num_steps: engine steps (HF: forward passes, summed over its batches).
        prefill_tokens: prompt (and forced) tokens computed in prefill chunks (HF: padding
            included).
        cached_tokens: prompt tokens reused from the prefix cache.
        decode_tokens: tokens computed one at a time (HF: padding rows included).
        forced_tokens: output tokens jump-forward appended.
        masked_rows: constrained rows masked (one per sampled token of a constrained answer).
        mask_seconds: wall time computing the bitmasks and applying them.
    """

    name: str
    constrained: bool
    token_ids: list[list[int]]
    texts: list[str]
    seconds: float
    prompt_tokens: int
    num_steps: int | None = None
    prefill_tokens: int | None = None
    cached_tokens: int | None = None
    decode_tokens: int | None = None
    forced_tokens: int | None = None
    masked_rows: int | None = None
    mask_seconds: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def sampled_tokens(self) -> int | None:
        """Output tokens the model chose (output minus forced)."""
        return None if self.forced_tokens is None else self.output_tokens - self.forced_tokens

    @property
    def throughput(self) -> float:
        """Output tokens per wall second."""
        return self.output_tokens / self.seconds

    @property
    def mask_us_per_row(self) -> float | None:
        """Microseconds of mask work per constrained row."""
        if not self.masked_rows or self.mask_seconds is None:
            return None
        return 1e6 * self.mask_seconds / self.masked_rows


def _stop_ids(model) -> tuple[int, ...]:
    eos = model.generation_config.eos_token_id
    return () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)


def _through_stop(ids: list[int], stop: Sequence[int]) -> list[int]:
    """``ids`` through the first stop token (HF pads finished rows after it)."""
    for i, t in enumerate(ids):
        if t in stop:
            return ids[: i + 1]
    return ids


class _MaskTimer:
    """Wraps a mask function ``fn(logits, requests)`` and adds up its wall time and the rows
    it masked (requests with a grammar)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.seconds = 0.0
        self.rows = 0

    def __call__(self, logits: torch.Tensor, requests: list) -> None:
        t0 = time.perf_counter()
        self.fn(logits, requests)
        self.seconds += time.perf_counter() - t0
        self.rows += sum(r.grammar is not None for r in requests)


def run_minirad(
    model,
    processor,
    workload: Workload,
    name: str,
    params: SamplingParams,
    batch_size: int,
    jump_forward: bool = True,
    **engine_kwargs,
) -> StructuredRun:
    """Every request submitted at once to a fresh :class:`LLMEngine` (``max_num_seqs =
    batch_size``, ``jump_forward``, ``engine_kwargs``: other ``EngineConfig`` fields), so
    each run compiles its grammar again. The mask is timed around the engine's
    ``_apply_grammars`` (the per-step bitmask fill and masked fill, nothing else)."""
    engine = LLMEngine(
        model, processor, max_num_seqs=batch_size, jump_forward=jump_forward, **engine_kwargs
    )
    timer = _MaskTimer(engine._apply_grammars)
    engine._apply_grammars = timer  # the instance attribute shadows the static method
    t0 = time.perf_counter()
    outs = engine.generate([GenerateRequest(t, ims, params) for t, ims in workload.requests])
    seconds = time.perf_counter() - t0
    st = engine.stats
    constrained = params.structured_output_kind is not None
    return StructuredRun(
        name,
        constrained,
        [o.token_ids for o in outs],
        [o.text for o in outs],
        seconds,
        sum(len(o.prompt_token_ids) for o in outs),
        num_steps=st.num_steps,
        prefill_tokens=st.prefill_tokens,
        cached_tokens=st.cached_tokens,
        decode_tokens=st.decode_tokens,
        forced_tokens=st.forced_tokens,
        masked_rows=timer.rows if constrained else None,
        mask_seconds=timer.seconds if constrained else None,
    )


class _TimedGrammarProcessor(GrammarLogitsProcessor):
    """:class:`GrammarLogitsProcessor` that adds up its wall time, its calls (one per forward
    pass) and the rows it masked."""

    def __init__(self, grammars, prompt_length: int) -> None:
        super().__init__(grammars, prompt_length)
        self.seconds = 0.0
        self.calls = 0
        self.rows = 0

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter()
        scores = super().__call__(input_ids, scores)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        # A row that accepted its stop token in this call was not masked.
        self.rows += sum(not g.stopped for g in self.grammars)
        return scores


@torch.no_grad()
def run_hf_grammar(
    model,
    processor,
    workload: Workload,
    schema: dict,
    batch_size: int,
    max_new_tokens: int,
) -> StructuredRun:
    """HF ``generate()``, greedy, on left-padded static batches of ``batch_size``, each row
    under its own copy of the grammar (one :class:`~minirad.engine.grammar.GrammarCompiler`, so
    compiled once per run, as in our engine), ending on the model's stop tokens."""
    tokenizer = processor.tokenizer
    stop = _stop_ids(model)
    compiler = GrammarCompiler(tokenizer, model.config.text_config.vocab_size)
    params = SamplingParams(max_new_tokens=max_new_tokens, json_schema=schema)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    token_ids: list[list[int]] = []
    steps = prompt_tokens = prefill = decode = rows = 0
    mask_seconds = 0.0
    try:
        t0 = time.perf_counter()
        for b in range(0, len(workload.requests), batch_size):
            batch = workload.requests[b : b + batch_size]
            inputs = processor(
                text=[t for t, _ in batch],
                images=[im for _, ims in batch for im in ims],
                padding=True,
                return_tensors="pt",
            )
            n = inputs["input_ids"].shape[1]
            mask = _TimedGrammarProcessor([compiler.compile(params, stop) for _ in batch], n)
            seqs = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([mask]),
            )
            token_ids += [_through_stop(row[n:].tolist(), stop) for row in seqs]
            steps += mask.calls
            prefill += inputs["input_ids"].numel()
            prompt_tokens += int(inputs["attention_mask"].sum())
            decode += len(batch) * (mask.calls - 1)
            rows += mask.rows
            mask_seconds += mask.seconds
        seconds = time.perf_counter() - t0
    finally:
        tokenizer.padding_side = side
    return StructuredRun(
        "HF + grammar",
        True,
        token_ids,
        [tokenizer.decode(t, skip_special_tokens=True) for t in token_ids],
        seconds,
        prompt_tokens,
        num_steps=steps,
        prefill_tokens=prefill,
        cached_tokens=0,
        decode_tokens=decode,
        forced_tokens=0,
        masked_rows=rows,
        mask_seconds=mask_seconds,
    )


def vllm_schema(schema: dict) -> dict:
    """``schema`` with llguidance's JSON options in its ``"x-guidance"`` key (our
    :data:`~minirad.engine.grammar.JSON_DEFAULTS`, the schema's own options winning), the way to
    give vLLM 0.32 our compact separators (see the module docstring)."""
    return {**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}}


def run_vllm(
    peer: VLLMPeer, tokenizer, workload: Workload, max_new_tokens: int, schema: dict | None
) -> StructuredRun:
    """The workload through the real vLLM (one ``LLM.generate`` call, timed inside its
    worker), with ``schema`` as its structured output (``StructuredOutputsParams(json=...)``)
    or free (None). Its caches are reset first, as each of our runs gets a fresh engine."""
    if not peer.reset_prefix_cache():
        raise InvalidArgumentError("vLLM refused to reset its prefix cache")
    structured = None if schema is None else {"json": vllm_schema(schema)}
    run = peer.generate(workload, max_new_tokens, structured=structured)
    label = "guidance" if schema is not None else "free"
    return StructuredRun(
        f"vLLM {label}",
        schema is not None,
        run.outputs,
        [tokenizer.decode(t, skip_special_tokens=True) for t in run.outputs],
        run.seconds,
        run.prompt_tokens,
        prefill_tokens=run.prefill_tokens,
        cached_tokens=run.cached_tokens,
        forced_tokens=0,  # vLLM 0.32's guidance backend has no jump-forward
    )


@dataclass
class StructuredResult:
    """Every run of one invocation, and how their answers score.

    Attributes:
        references: each scene's reference answer (:func:`minirad.course.scenes.shapes_json`).
        runs: (a), (b), (c), (d), then vLLM's (free, guidance) if any.
    """

    workload: Workload
    schema: dict
    batch_size: int
    max_new_tokens: int
    references: list[str]
    runs: list[StructuredRun] = field(default_factory=list)

    def run(self, name: str) -> StructuredRun:
        """The run called ``name``.

        Raises:
            KeyError: no such run.
        """
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    def parses(self, run: StructuredRun) -> int:
        """Answers that parse as JSON."""
        return sum(_loads(t) is not None for t in run.texts)

    def validates(self, run: StructuredRun) -> int:
        """Answers that parse and validate against the schema."""
        return sum(_valid(t, self.schema) for t in run.texts)

    def exact(self, run: StructuredRun) -> int:
        """Answers equal to the reference."""
        return sum(t == r for t, r in zip(run.texts, self.references, strict=True))

    def same_text(self, run: StructuredRun, other: StructuredRun) -> int:
        """Answers whose text equals ``other``'s (stop tokens aside)."""
        return sum(a == b for a, b in zip(run.texts, other.texts, strict=True))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _valid(text: str, schema: dict) -> bool:
    value = _loads(text)
    if value is None:
        return False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


FREE, GRAMMAR, JUMP, HF = "free", "grammar", "grammar + jf", "HF + grammar"


def run_structured_benchmark(
    model,
    processor,
    num_scenes: int = 50,
    seed: int = DEFAULT_SEED,
    batch_size: int = 8,
    max_new_tokens: int = 128,
    repeat: int = 3,
    peer: VLLMPeer | None = None,
    hf: bool = True,
    **engine_kwargs,
) -> StructuredResult:
    """Runs (a)-(e) of the module docstring, ``repeat`` times in turn, keeping each one's
    fastest; one warm-up request through every system first.

    Raises:
        InvalidArgumentError: ``repeat`` < 1, an unknown engine setting, or a peer that runs
            another number of requests at once than ``batch_size``.
        PeerError: the peer failed (:class:`~minirad.bench.peer.VLLMPeer`).
    """
    if repeat < 1:
        raise InvalidArgumentError(f"repeat must be >= 1, got {repeat}")
    if peer is not None and peer.info["max_num_seqs"] != batch_size:
        raise InvalidArgumentError(
            f"the peer runs {peer.info['max_num_seqs']} requests at once, the bench {batch_size}"
        )
    workload, scenes = json_workload(processor, num_scenes, seed)
    schema = SHAPES_JSON_SCHEMA
    free = SamplingParams(max_new_tokens=max_new_tokens)
    constrained = SamplingParams(max_new_tokens=max_new_tokens, json_schema=schema)
    tokenizer = processor.tokenizer
    systems: list[tuple[str, Callable[[Workload], StructuredRun]]] = [
        (FREE, lambda w: run_minirad(model, processor, w, FREE, free, batch_size, **engine_kwargs)),
        (
            GRAMMAR,
            lambda w: run_minirad(
                model, processor, w, GRAMMAR, constrained, batch_size, False, **engine_kwargs
            ),
        ),
        (
            JUMP,
            lambda w: run_minirad(
                model, processor, w, JUMP, constrained, batch_size, True, **engine_kwargs
            ),
        ),
    ]
    if hf:
        systems.append(
            (HF, lambda w: run_hf_grammar(model, processor, w, schema, batch_size, max_new_tokens))
        )
    if peer is not None:
        for s in (None, schema):

            def vllm(w: Workload, s: dict | None = s) -> StructuredRun:
                run = run_vllm(peer, tokenizer, w, max_new_tokens, s)
                time.sleep(peer.idle_s)  # vLLM's worker busy-polls a while after each call
                return run

            systems.append(("vLLM guidance" if s else "vLLM free", vllm))
    warm = Workload("warm-up", "", workload.requests[:1])
    for _, system in systems:
        system(warm)
    best: dict[str, StructuredRun] = {}
    for _ in range(repeat):
        for name, system in systems:
            run = system(workload)
            if name not in best or run.seconds < best[name].seconds:
                best[name] = run
    result = StructuredResult(
        workload, schema, batch_size, max_new_tokens, [shapes_json(s) for s in scenes]
    )
    result.runs = [best[name] for name, _ in systems]
    return result


def _num(value: int | float | None, fmt: str = "d") -> str:
    return "n/a" if value is None else f"{value:{fmt}}"


def _ratio(value: float, ref: float) -> str:
    return f"{value / ref:.2f}x" if ref else "n/a"


def format_report(result: StructuredResult, threads: dict[str, str] | None = None) -> str:
    """One column per run: throughput with its ratio to (a) and to (b), the engine's work,
    the mask's cost, and the answers' scores; ``threads`` printed last."""
    runs = result.runs
    free, grammar = result.run(FREE), result.run(GRAMMAR)
    hf = next((r for r in runs if r.name == HF), None)
    n = len(result.references)

    def share(k: int) -> str:
        return f"{k}/{n} ({100 * k / n:.0f}%)"

    def masked_share(r: StructuredRun) -> str:
        if r.mask_seconds is None:
            return "n/a"
        return f"{100 * r.mask_seconds / r.seconds:.1f}%"

    rows = [
        ("output tokens/s", [f"{r.throughput:.1f}" for r in runs]),
        ("  vs free", [_ratio(r.throughput, free.throughput) for r in runs]),
        ("  vs grammar", [_ratio(r.throughput, grammar.throughput) for r in runs]),
        ("wall time, s", [f"{r.seconds:.3f}" for r in runs]),
        ("prompt tokens", [f"{r.prompt_tokens}" for r in runs]),
        ("output tokens", [f"{r.output_tokens}" for r in runs]),
        ("  sampled", [_num(r.sampled_tokens) for r in runs]),
        ("  forced (jump-forward)", [_num(r.forced_tokens) for r in runs]),
        ("engine steps", [_num(r.num_steps) for r in runs]),
        ("prefill tokens", [_num(r.prefill_tokens) for r in runs]),
        ("cached tokens", [_num(r.cached_tokens) for r in runs]),
        ("decode tokens", [_num(r.decode_tokens) for r in runs]),
        ("masked rows", [_num(r.masked_rows) for r in runs]),
        ("mask, us/row", [_num(r.mask_us_per_row, ".1f") for r in runs]),
        ("mask, % of wall", [masked_share(r) for r in runs]),
        ("parses as JSON", [share(result.parses(r)) for r in runs]),
        ("valid against schema", [share(result.validates(r)) for r in runs]),
        ("exact match", [share(result.exact(r)) for r in runs]),
        ("same text as grammar", [share(result.same_text(r, grammar)) for r in runs]),
    ]
    if hf is not None:
        rows.append(("same text as HF", [share(result.same_text(r, hf)) for r in runs]))
    names = [r.name for r in runs]
    w0 = max(len(k) for k, _ in rows)
    widths = [max(len(nm), *(len(v[i]) for _, v in rows)) for i, nm in enumerate(names)]
    lines = [
        f"workload {result.workload.name}: {result.workload.description} (batch "
        f"{result.batch_size}, <= {result.max_new_tokens} new tokens, greedy)",
        " " * w0 + "".join(f"  {nm:>{w}}" for nm, w in zip(names, widths, strict=True)),
    ]
    for k, vals in rows:
        lines.append(
            f"{k:<{w0}}" + "".join(f"  {v:>{w}}" for v, w in zip(vals, widths, strict=True))
        )
    notes = [
        "free / grammar / grammar + jf: our engine, no constraint / SHAPES_JSON_SCHEMA, "
        "jump_forward off / on.",
        "mask: wall time filling the grammar's bitmask and applying it, per constrained row "
        "masked (our engine: LLMEngine._apply_grammars; HF: GrammarLogitsProcessor, which also "
        "advances the grammar by the previous token).",
        "HF: steps are forward passes; its prefill and decode tokens include padding.",
    ]
    if any(r.name.startswith("vLLM") for r in runs):
        notes.append(
            "vLLM: timed inside its worker around LLM.generate; backend guidance (llguidance), "
            "the schema's x-guidance gives our separators; no jump-forward in vLLM 0.32; "
            "steps, decode tokens and mask time are not reported (n/a)."
        )
    blocks = ["\n".join(lines), "\n".join(notes)]
    if threads:
        blocks.append("threads:\n" + "\n".join(f"{k}: {v}" for k, v in threads.items()))
    return "\n\n".join(blocks)


PEERS = ("vllm",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``structured`` subcommand's options."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    parser.add_argument("--scenes", type=positive_int, default=50, help="fresh scenes (requests)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the scenes")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="requests in flight")
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="most tokens an answer may get (a 3-shape answer is 86)",
    )
    parser.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="runs per system; the fastest is kept"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    parser.add_argument(
        "--peer",
        choices=PEERS,
        default=None,
        help="also run the real vLLM's structured outputs (its own venv, `make vllm`; about "
        "40 s to start)",
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench structured``: print the report; exit 1 if a constrained
    answer does not validate against the schema.

    Raises:
        InvalidArgumentError: no model folder.
        PeerError: ``--peer vllm`` without the vLLM venv (the message says how to build it),
            or the vLLM worker failed.
    """
    if not Path(args.model).is_dir():
        raise InvalidArgumentError(f"model folder {args.model!r} not found")
    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()
    with contextlib.ExitStack() as stack:
        peer = None
        if args.peer == "vllm":
            from minirad.bench.peer import VLLMPeer

            peer = stack.enter_context(
                VLLMPeer(
                    args.model,
                    max_num_seqs=args.batch_size,
                    structured_outputs_backend="guidance",
                )
            )
        model, processor = load_model(args.model)
        result = run_structured_benchmark(
            model,
            processor,
            args.scenes,
            args.seed,
            args.batch_size,
            args.max_new_tokens,
            args.repeat,
            peer=peer,
            hf=not args.no_hf,
        )
        from minirad.bench.peer import report_threads  # peer.py imports bench.engine's types

        threads = report_threads(peer)
    print(format_report(result, threads))
    print(f"Each system's fastest of {args.repeat} runs.")
    n = len(result.references)
    return int(any(result.validates(r) < n for r in result.runs if r.constrained))
