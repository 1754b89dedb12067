"""Engine benchmark: the same requests through Hugging Face ``generate()``, our engine and,
with ``--peer vllm`` and / or ``--peer sglang``, the real vLLM and SGLang.

Three workloads, greedy, with the same number of requests in flight: *shared* (images x questions
behind one system prompt: what the radix tree and the encoder cache save), *unique* (nothing
to share: the engine's overhead) and *text* (no images: system prompts that describe a scene in
words, several questions each; the one SGLang can run, as it serves no LLaVA on CPU). The
systems take turns within one invocation; each keeps its fastest run, and every answer must
match HF's token for token. What each system runs and what each row measures:
docs/benchmarks.md, "The engine against Hugging Face and vLLM".
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from PIL import Image
from transformers import LogitsProcessor, LogitsProcessorList

from minirad.bench.common import KVMemory, RunResult, Workload
from minirad.bench.rss import peak_rss
from minirad.course.scenes import (
    CAPTION_PROMPT,
    DEFAULT_IMAGE_SIZE,
    SYSTEM_PROMPTS,
    Scene,
    ask,
    caption,
    random_scene,
    render,
    shapes_json,
)
from minirad.engine import (
    PREFIX_STRATEGIES,
    GenerateRequest,
    LLMEngine,
    SamplingParams,
    resolve_device,
)
from minirad.entrypoints.argtypes import DTYPES, positive_int, thread_count
from minirad.errors import InvalidArgumentError, PeerError
from minirad.models import DEFAULT_MODEL_DIR, load_model

if TYPE_CHECKING:
    from minirad.bench.peer import WorkerPeer

__all__ = [
    "WorkloadResult",
    "add_arguments",
    "default_workloads",
    "format_report",
    "run_cli",
    "run_engine_benchmark",
    "run_hf",
    "run_minirad",
    "shared_workload",
    "text_workload",
    "unique_workload",
]

SYSTEM_PROMPT = SYSTEM_PROMPTS[1]
QUESTIONS = (
    CAPTION_PROMPT,
    "How many shapes are there?",
    "What colour is the circle?",
    "What colour is the square?",
    "What colour is the triangle?",
    "What shape is the red one?",
    "What shape is the blue one?",
    "Is there a green triangle?",
)


def _template(processor, question: str, system_prompt: str | None, image: bool = True) -> str:
    """One image (unless not ``image``), then the question, in the processor's chat template
    (a system turn first if ``system_prompt``)."""
    if getattr(processor, "chat_template", None) is None:
        raise InvalidArgumentError(
            "the benchmark needs a model whose processor has a chat template"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    content = [{"type": "image"}] if image else []
    content.append({"type": "text", "text": question})
    messages.append({"role": "user", "content": content})
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def shared_workload(
    processor, images: Sequence[Image.Image], questions: Sequence[str], system_prompt: str
) -> Workload:
    """Workload (a): every question about every image, image by image, after one shared
    system prompt."""
    reqs = [(_template(processor, q, system_prompt), [im]) for im in images for q in questions]
    return Workload(
        "shared",
        f"{len(images)} images x {len(questions)} questions, shared system prompt",
        reqs,
    )


def unique_workload(processor, images: Sequence[Image.Image], questions: Sequence[str]) -> Workload:
    """Workload (b): image ``i`` with question ``i``, no system prompt.

    Raises:
        InvalidArgumentError: the images or questions are not distinct, or their numbers differ.
    """
    if len(images) != len(questions) or len(set(questions)) != len(questions):
        raise InvalidArgumentError("unique workload: need as many distinct questions as images")
    if len({im.tobytes() for im in images}) != len(images):
        raise InvalidArgumentError("unique workload: images must be distinct")
    reqs = [(_template(processor, q, None), [im]) for im, q in zip(images, questions, strict=True)]
    return Workload("unique", f"{len(images)} distinct images, each with its own question", reqs)


def text_workload(processor, system_prompts: Sequence[str], questions: Sequence[str]) -> Workload:
    """Workload (c): every question after every system prompt, prompt by prompt, no images."""
    reqs = [
        (_template(processor, q, s, image=False), []) for s in system_prompts for q in questions
    ]
    return Workload(
        "text",
        f"{len(system_prompts)} system prompts x {len(questions)} questions, no images",
        reqs,
    )


def scene_system_prompt(scene: Scene) -> str:
    """A system prompt that gives ``scene`` in words instead of a picture: the shared
    workload's system prompt, the scene's caption and its shapes as JSON."""
    return f"{SYSTEM_PROMPT} The picture shows {caption(scene)}. As JSON: {shapes_json(scene)}"


WORKLOADS = ("shared", "unique", "text")


def default_workloads(
    processor,
    num_images: int = 16,
    num_questions: int = 8,
    num_unique: int = 64,
    seed: int = 0,
    names: Sequence[str] = ("shared", "unique"),
    num_system_prompts: int = 16,
) -> list[Workload]:
    """The workloads ``names`` (of :data:`WORKLOADS`, in that order) over scenes of
    :mod:`minirad.course.scenes` (``num_questions`` at most 8). The text workload's system
    prompts describe ``num_system_prompts`` scenes of their own (:func:`scene_system_prompt`)
    and ask the shared workload's questions.

    Raises:
        InvalidArgumentError: a bad count or an unknown workload.
    """
    if not 1 <= num_questions <= len(QUESTIONS):
        raise InvalidArgumentError(f"num_questions must be in 1..{len(QUESTIONS)}")
    if unknown := set(names) - set(WORKLOADS):
        raise InvalidArgumentError(f"unknown workloads {sorted(unknown)}; known: {WORKLOADS}")
    if not names:
        raise InvalidArgumentError("no workload")
    rng = random.Random(seed)
    scenes = [random_scene(rng, DEFAULT_IMAGE_SIZE) for _ in range(num_images + num_unique)]
    unique_scenes, questions = [], []
    pending = scenes[num_images:]
    # A distinct question per scene (varying scenes, types); a scene that has no question
    # left (a lone shape asks few) is replaced by a new one, at most num_unique times.
    for _ in range(2 * num_unique):
        if len(questions) == num_unique:
            break
        scene = pending.pop(0) if pending else random_scene(rng, DEFAULT_IMAGE_SIZE)
        for _ in range(100):
            q = ask(scene, rng.choice(("colour", "shape", "exists", "where")), rng)
            if q is not None and q.prompt not in questions:
                unique_scenes.append(scene)
                questions.append(q.prompt)
                break
    if len(questions) < num_unique:
        raise InvalidArgumentError(f"cannot draw {num_unique} distinct questions")
    # Drawn after the others, so that a seed's shared and unique workloads stay as they were.
    text_scenes = [random_scene(rng, DEFAULT_IMAGE_SIZE) for _ in range(num_system_prompts)]
    workloads = {
        "shared": lambda: shared_workload(
            processor,
            [render(s) for s in scenes[:num_images]],
            QUESTIONS[:num_questions],
            SYSTEM_PROMPT,
        ),
        "unique": lambda: unique_workload(processor, [render(s) for s in unique_scenes], questions),
        "text": lambda: text_workload(
            processor,
            [scene_system_prompt(s) for s in text_scenes],
            QUESTIONS[:num_questions],
        ),
    }
    return [workloads[name]() for name in WORKLOADS if name in names]


class _FirstTokenTimer(LogitsProcessor):
    """Records when ``generate()`` first asks for logits processing: the prefill is done."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def _cut_at_stop(ids: list[int], stop: frozenset[int]) -> list[int]:
    """``ids`` through the first stop token (HF pads finished rows after it)."""
    for i, t in enumerate(ids):
        if t in stop:
            return ids[: i + 1]
    return ids


def _stop_ids(model) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    return frozenset(() if eos is None else eos if isinstance(eos, list | tuple) else (eos,))


@torch.no_grad()
def run_hf(model, processor, workload: Workload, batch_size: int, max_new_tokens: int) -> RunResult:
    """HF ``generate()`` on static, left-padded batches of ``batch_size`` requests."""
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    stop = _stop_ids(model)
    outputs: list[list[int]] = []
    prompts: list[list[int]] = []
    ttft, from_start, prefill, images = [], [], 0, 0
    try:
        t0 = time.perf_counter()
        for b in range(0, len(workload.requests), batch_size):
            batch = workload.requests[b : b + batch_size]
            start = time.perf_counter()
            texts = [t for t, _ in batch]
            ims = [im for _, imgs in batch for im in imgs]
            inputs = processor(text=texts, images=ims or None, padding=True, return_tensors="pt")
            inputs = inputs.to(model.device)
            timer = _FirstTokenTimer()
            seqs = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([timer]),
            )
            n = inputs["input_ids"].shape[1]
            outputs += [_cut_at_stop(row[n:].tolist(), stop) for row in seqs]
            for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True):
                prompts.append(ids[mask.bool()].tolist())
            ttft += [timer.first - start] * len(batch)
            from_start += [timer.first - t0] * len(batch)
            prefill += inputs["input_ids"].numel()
            images += len(ims)
        seconds = time.perf_counter() - t0
    finally:
        tokenizer.padding_side = side
    return RunResult(
        "HF generate",
        outputs,
        seconds,
        ttft,
        from_start,
        prefill,
        images,
        prompt_token_ids=prompts,
        num_cached_tokens=[0] * len(prompts),
    )


def run_minirad(
    model, processor, workload: Workload, batch_size: int, max_new_tokens: int, **engine_kwargs
) -> RunResult:
    """Every request submitted at once to a fresh :class:`LLMEngine` with
    ``max_num_seqs=batch_size`` (``engine_kwargs``: other :class:`EngineConfig` fields).
    Its :class:`KVMemory` comes from the engine's ``KVCache`` and allocator."""
    engine = LLMEngine(model, processor, max_num_seqs=batch_size, **engine_kwargs)
    allocator, tree = engine.allocator, engine.tree_cache
    params = SamplingParams(max_new_tokens=max_new_tokens)
    t0 = time.perf_counter()
    submitted, first, outputs = {}, {}, {}
    for text, images in workload.requests:
        rid = engine.add_request(GenerateRequest(text, images, params))
        submitted[rid] = time.perf_counter()
    rids = list(submitted)
    peak_usage = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.rid, time.perf_counter())
            if out.finished:
                outputs[out.rid] = out
        # After the step, as vLLM samples its KV cache usage: what running requests hold.
        peak_usage = max(peak_usage, allocator.used_size() - tree.evictable_size())
    seconds = time.perf_counter() - t0
    st = engine.stats
    strategy = engine.config.prefix_strategy
    kv = engine.kv_cache
    return RunResult(
        f"minirad {strategy}",
        [outputs[r].token_ids for r in rids],
        seconds,
        [first[r] - submitted[r] for r in rids],
        [first[r] - t0 for r in rids],
        st.prefill_tokens,
        st.encoder_calls,
        st.cached_tokens,
        prompt_token_ids=[outputs[r].prompt_token_ids for r in rids],
        num_cached_tokens=[outputs[r].stats.cached_tokens for r in rids],
        kv=KVMemory(
            bytes_per_token=kv.bytes_per_token,
            pool_tokens=kv.num_slots,
            pool_bytes=kv.nbytes,
            block_size=kv.block_size,
            peak_usage=peak_usage,
            peak_held=allocator.peak_used_size,
        ),
    )


@dataclass
class WorkloadResult:
    """HF, every minirad run and each peer's run (if any) of one workload."""

    workload: Workload
    batch_size: int
    max_new_tokens: int
    hf: RunResult
    minirad: list[RunResult] = field(default_factory=list)
    peers: list[RunResult] = field(default_factory=list)

    @property
    def runs(self) -> list[RunResult]:
        """HF first, then minirad's runs, then the peers'."""
        return [self.hf, *self.minirad, *self.peers]

    def mismatches(self, run: RunResult) -> int:
        """Requests whose answer differs from HF's."""
        return sum(a != b for a, b in zip(run.outputs, self.hf.outputs, strict=True))


def run_engine_benchmark(
    model,
    processor,
    workloads: Sequence[Workload],
    batch_size: int = 8,
    max_new_tokens: int = 16,
    strategies: Sequence[str] = ("radix", "none"),
    repeat: int = 1,
    peers: Sequence[WorkerPeer] = (),
    **engine_kwargs,
) -> list[WorkloadResult]:
    """Run every workload through HF, through the engine once per prefix strategy and
    through each of ``peers`` (a real vLLM, a real SGLang), ``repeat`` times in turn, keeping
    each system's fastest run (as ``timeit`` does: on a shared machine the slower runs measure
    the other jobs). A peer's prefix caches (and vLLM's image and encoder caches) are reset
    before each of its runs, as each minirad run gets a fresh engine, and after each run it
    gets its ``idle_s`` to stop polling before the next system runs. Every run's ``rss`` is the
    peak RSS of the processes that run it, over the run (:func:`~minirad.bench.rss.peak_rss`:
    this process for HF and minirad, the peer's processes for a peer).

    One warm-up ``generate()`` first on every side, so that none pays for first-call costs.

    Raises:
        InvalidArgumentError: an unknown strategy or engine setting, ``repeat`` < 1, a
            peer that runs another number of requests at once than ``batch_size``, or a
            workload a peer cannot run (SGLang: images).
        PeerError: a peer failed (see :class:`~minirad.bench.peer.VLLMPeer`,
            :class:`~minirad.bench.sglang_peer.SGLangPeer`).
    """
    if unknown := set(strategies) - set(PREFIX_STRATEGIES):
        raise InvalidArgumentError(f"unknown prefix strategies {sorted(unknown)}")
    if repeat < 1:
        raise InvalidArgumentError(f"repeat must be >= 1, got {repeat}")
    for peer in peers:
        if peer.max_num_seqs != batch_size:
            raise InvalidArgumentError(
                f"{peer.name} runs {peer.max_num_seqs} requests at once, the bench {batch_size}"
            )
    warm = Workload("warm-up", "", workloads[0].requests[:1])
    run_hf(model, processor, warm, 1, 2)
    for peer in peers:
        peer.generate(warm, 2)
        time.sleep(peer.idle_s)

    def fastest(a: RunResult | None, b: RunResult) -> RunResult:
        return b if a is None or b.seconds < a.seconds else a

    def measured(run, *args, **kwargs) -> RunResult:
        """``run(*args, **kwargs)`` with this process's peak RSS over it."""
        with peak_rss() as memory:
            result = run(*args, **kwargs)
        result.rss = memory
        return result

    results = []
    for w in workloads:
        hf, runs, peer_runs = None, dict.fromkeys(strategies), [None] * len(peers)
        for _ in range(repeat):
            hf = fastest(hf, measured(run_hf, model, processor, w, batch_size, max_new_tokens))
            for s in strategies:
                run = measured(
                    run_minirad,
                    model,
                    processor,
                    w,
                    batch_size,
                    max_new_tokens,
                    prefix_strategy=s,
                    **engine_kwargs,
                )
                runs[s] = fastest(runs[s], run)
            for i, peer in enumerate(peers):
                if not peer.reset_prefix_cache():
                    raise PeerError(f"{peer.name} refused to reset its prefix cache")
                peer_runs[i] = fastest(peer_runs[i], peer.generate(w, max_new_tokens))
                time.sleep(peer.idle_s)
        results.append(
            WorkloadResult(w, batch_size, max_new_tokens, hf, list(runs.values()), peer_runs)
        )
    return results


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _cell(value: float | None, ref: float, fmt: str) -> str:
    if value is None:
        return "n/a"
    ratio = f" ({value / ref:.2f}x)" if ref else ""
    return f"{value:{fmt}}{ratio}"


def _table(r: WorkloadResult) -> str:
    runs, hf = r.runs, r.hf

    def ttft(x: RunResult, from_start: bool = False) -> float | None:
        xs = x.ttft_from_start if from_start else x.ttft
        return _mean(xs) if xs else None

    def kv(x: RunResult, cell) -> str:
        return "n/a" if x.kv is None else cell(x.kv)

    def mib(x: RunResult, name: str) -> str:
        value = None if x.rss is None else getattr(x.rss, name)
        return "n/a" if value is None else f"{value / 2**20:.0f}"

    rows = [
        ("output tokens/s", [_cell(x.throughput, hf.throughput, ".1f") for x in runs]),
        (
            "prompt+output tokens/s",
            [_cell(x.total_throughput, hf.total_throughput, ".1f") for x in runs],
        ),
        ("TTFT mean, s", [_cell(ttft(x), ttft(hf), ".4f") for x in runs]),
        (
            "  from run start, s",
            [_cell(ttft(x, True), ttft(hf, True), ".4f") for x in runs],
        ),
        ("prompt tokens", [f"{x.prompt_tokens}" for x in runs]),
        ("prefill tokens", [_cell(x.prefill_tokens, hf.prefill_tokens, "d") for x in runs]),
        ("cached tokens", [f"{x.cached_tokens}" for x in runs]),
        ("encoder calls", [_cell(x.encoder_calls, hf.encoder_calls, "d") for x in runs]),
        ("output tokens", [f"{x.output_tokens}" for x in runs]),
        ("wall time, s", [f"{x.seconds:.3f}" for x in runs]),
        ("mismatches vs HF", ["-"] + [f"{r.mismatches(x)}" for x in runs[1:]]),
        ("KV bytes/token", [kv(x, lambda m: f"{m.bytes_per_token}") for x in runs]),
        ("KV pool, tokens", [kv(x, lambda m: f"{m.pool_tokens}") for x in runs]),
        ("KV pool, MiB", [kv(x, lambda m: f"{m.pool_bytes / 2**20:.2f}") for x in runs]),
        (
            "peak KV usage, tokens",
            [kv(x, lambda m: m.percent(m.peak_usage, m.pool_tokens)) for x in runs],
        ),
        (
            "peak KV held, tokens",
            [kv(x, lambda m: m.percent(m.peak_held, m.pool_tokens)) for x in runs],
        ),
        ("peak RSS, MiB", [mib(x, "peak") for x in runs]),
        ("  at run start, MiB", [mib(x, "start") for x in runs]),
    ]
    names = [x.name for x in runs]
    w0 = max(len(k) for k, _ in rows)
    widths = [max(len(n), *(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
    lines = [
        f"workload {r.workload.name}: {r.workload.description} "
        f"({len(r.workload.requests)} requests, batch {r.batch_size}, "
        f"<= {r.max_new_tokens} new tokens, greedy)",
        " " * w0 + "".join(f"  {n:>{w}}" for n, w in zip(names, widths, strict=True)),
    ]
    for k, vals in rows:
        lines.append(
            f"{k:<{w0}}" + "".join(f"  {v:>{w}}" for v, w in zip(vals, widths, strict=True))
        )
    for p in r.peers:
        lines.append(
            f"against {p.name}: "
            + ", ".join(
                f"{x.name} {x.throughput / p.throughput:.2f}x output tokens/s" for x in r.minirad
            )
        )
    return "\n".join(lines)


def format_report(results: Sequence[WorkloadResult], threads: dict[str, str] | None = None) -> str:
    """A table per workload: one column per system, cells with their ratio to HF; with
    peers, minirad's throughput against each peer's. ``threads``: each side's thread
    settings, by side, printed last."""
    note = (
        "TTFT: minirad per request from submission (queueing included); HF per batch, its "
        "prefill from the batch's start.\n"
        "HF's prefill tokens include padding. Ratios in parentheses are x/HF.\n"
        "KV peaks in % of the pool. Usage: tokens running requests hold, sampled after every"
        " step (vLLM's KV cache usage; whole blocks); held: usage plus cached prefixes no"
        " request holds (the allocator's true peak).\n"
        "RSS: resident memory of the processes that run the system: its peak during the run"
        " (VmHWM, reset as the run starts; n/a where /proc cannot) and what was resident as the"
        " run started (weights, libraries, pools made before it);\n"
        "HF and minirad share this process and its weights, each run after a garbage"
        " collection and malloc_trim; minirad's KV pool is made in each run (in its peak only)."
    )
    peers = {p.name.split()[0] for r in results for p in r.peers}
    if "vLLM" in peers:
        note += (
            "\nvLLM: timed inside its worker process around LLM.generate; TTFT is vLLM's own"
            " (RequestOutput.metrics), per request from its arrival (queueing included);\n"
            "vLLM does not report vision-tower runs (n/a); its caches are reset before each"
            " run; its front end, engine core and model worker are processes of their own"
            " (threads and CPUs below).\n"
            "vLLM's RSS: the sum over those processes of each one's peak, its KV pool (made at"
            " start-up) included; pages they share count in each process: an upper bound."
        )
    if "SGLang" in peers:
        note += (
            "\nSGLang: the offline sglang.Engine, timed inside its worker process around the"
            " batch; TTFT is SGLang's own (meta_info first_token_latency), per request from its"
            " arrival (queueing included);\n"
            "it serves the LLaVA's text half (a LlamaForCausalLM of the same weights and"
            " tokenizer: SGLang 0.5.23 cannot serve LLaVA on CPU), so text workloads only; its"
            " radix tree is flushed before each run; its KV pool is as large as ours"
            " (--num-kv-slots) and reports no per-step usage (n/a);\n"
            "its tokenizer manager, scheduler (the model) and detokenizer are processes of"
            " their own (threads and CPUs below); its RSS is summed over them, as vLLM's."
        )
    blocks = [_table(r) for r in results] + [note]
    if threads:
        blocks.append("threads:\n" + "\n".join(f"{k}: {v}" for k, v in threads.items()))
    return "\n\n".join(blocks)


PEERS = ("vllm", "sglang")


def _names(choices: Sequence[str]):
    """``argparse`` type: a comma-separated list of ``choices`` (for ``action="extend"``)."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(
                f"must be one or more of {', '.join(choices)} (comma-separated), got {text!r}"
            )
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``engine`` subcommand's options."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    parser.add_argument(
        "--workload",
        dest="workloads",
        type=_names(WORKLOADS),
        action="extend",
        default=None,
        metavar="NAME",
        help="workloads to run, repeatable or comma-separated: shared (a), unique (b), text (c: "
        "no images, the one SGLang runs); default: shared and unique",
    )
    parser.add_argument("--images", type=positive_int, default=16, help="workload (a) images")
    parser.add_argument(
        "--questions",
        type=positive_int,
        default=8,
        help="workload (a) questions per image, (c) per system prompt (<= 8)",
    )
    parser.add_argument("--unique", type=positive_int, default=64, help="workload (b) requests")
    parser.add_argument(
        "--system-prompts",
        type=positive_int,
        default=16,
        help="workload (c) system prompts (each a scene in words)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="requests in flight")
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=16, help="most tokens each answer may get"
    )
    parser.add_argument("--num-kv-slots", type=positive_int, default=4096, help="KV pool, tokens")
    parser.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenes")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="every system's weights, activations and KV (bfloat16: answers may differ at "
        "near-ties, so differing answers are counted but do not fail the run)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where HF and minirad run (cpu, cuda, cuda:1...)"
    )
    parser.add_argument(  # "%(default)s" in the help: argparse adds no "(default: True)"
        "--no-prepack-weights",
        dest="prepack_weights",
        action="store_false",
        help="minirad without its oneDNN-packed weight copies (EngineConfig.prepack_weights: "
        "%(default)s without this flag, False with it)",
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="runs per system; the fastest is kept"
    )
    parser.add_argument(
        "--peer",
        dest="peers",
        type=_names(PEERS),
        action="extend",
        default=None,
        metavar="NAME",
        help="also run real engines, repeatable or comma-separated: vllm (its own venv, `make "
        "vllm`; 1 to 2 minutes to start on 2 cores), sglang (`make sglang`; 1 to 4 minutes; "
        "text workload only: SGLang 0.5.23 serves no LLaVA on CPU, so it runs the LLaVA's "
        "text half)",
    )
    parser.add_argument(
        "--peer-num-gpu-blocks",
        type=positive_int,
        default=None,
        help="vLLM's KV pool in blocks of 32 tokens, its null block included "
        "(num_gpu_blocks_override; e.g. num-kv-slots / 32 + 1 for minirad's pool); "
        "default: what 1 GiB holds",
    )
    from minirad.bench.sglang_peer import SCHEDULE_POLICIES  # standard library and msgspec

    parser.add_argument(
        "--peer-schedule-policy",
        default=None,
        choices=SCHEDULE_POLICIES,
        metavar="POLICY",
        help="SGLang's --schedule-policy (fcfs, lpm, dfs-weight...); default: its own, fcfs, "
        "which unlike lpm and our engine computes a prefix shared within one batch once per "
        "request",
    )
    parser.add_argument(
        "--peer-omp-threads-bind",
        default=None,
        metavar="CPUS",
        help="the CPUs of each peer's OpenMP compute threads, one thread per CPU: vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND (e.g. 0-1 for both cores of a 2-core machine, auto, "
        "nobind); SGLang's processes pinned to them (0-1, 0,1); default: vLLM's auto (on a "
        "small machine one core for compute, the other left to its front end), SGLang "
        "unpinned with one OpenMP thread",
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench engine``: print the report; exit 1 if answers differ in
    fp32 (in bf16, kernels that add in other orders may break near-ties differently).

    Raises:
        InvalidArgumentError: no model folder, ``--peer-num-gpu-blocks`` without the vLLM
            peer, ``--peer-schedule-policy`` without the SGLang peer (or one it lacks),
            ``--peer-omp-threads-bind`` without a peer, ``--peer sglang`` with a
            workload that has images (checked before anything starts), a ``--device`` this
            process cannot use (:func:`~minirad.engine.resolve_device`), or a peer with a
            device other than cpu.
        PeerError: a peer without its venv (the message says how to build it), or its worker
            failed.
    """
    peers = list(dict.fromkeys(args.peers or ()))  # in the order given, each once
    names = args.workloads or ["shared", "unique"]
    if not Path(args.model).is_dir():
        raise InvalidArgumentError(f"model folder {args.model!r} not found")
    if args.peer_num_gpu_blocks is not None and "vllm" not in peers:
        raise InvalidArgumentError("--peer-num-gpu-blocks sizes vLLM's pool: give --peer vllm")
    if args.peer_schedule_policy is not None and "sglang" not in peers:
        raise InvalidArgumentError("--peer-schedule-policy is SGLang's: give --peer sglang")
    if args.peer_omp_threads_bind is not None and not peers:
        raise InvalidArgumentError("--peer-omp-threads-bind binds the peer's threads: give --peer")
    if "sglang" in peers:
        from minirad.bench.sglang_peer import NO_IMAGES, cpu_list

        if with_images := [n for n in names if n != "text"]:
            raise InvalidArgumentError(
                f"{NO_IMAGES}: run it with --workload text (not {', '.join(with_images)})"
            )
        if args.peer_omp_threads_bind is not None:  # before any peer starts
            cpu_list(args.peer_omp_threads_bind)
    device = resolve_device(args.device)
    if device.type != "cpu" and peers:
        raise InvalidArgumentError(
            f"--peer {','.join(peers)}: CPU builds, run them with --device cpu"
        )
    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()  # "Loading weights" bars would mix with the report
    with contextlib.ExitStack() as stack:
        running = []
        for name in peers:
            if name == "vllm":
                from minirad.bench.peer import VLLMPeer

                peer = VLLMPeer(
                    args.model,
                    max_num_seqs=args.batch_size,
                    num_gpu_blocks_override=args.peer_num_gpu_blocks,
                    omp_threads_bind=args.peer_omp_threads_bind,
                    dtype=args.dtype,
                )
            else:
                from minirad.bench.sglang_peer import SGLangPeer

                peer = SGLangPeer(
                    args.model,
                    max_running_requests=args.batch_size,
                    max_total_tokens=args.num_kv_slots,
                    page_size=args.page_size,
                    schedule_policy=args.peer_schedule_policy,
                    omp_threads_bind=args.peer_omp_threads_bind,
                    dtype=args.dtype,
                )
            running.append(stack.enter_context(peer))
        model, processor = load_model(args.model, dtype=getattr(torch, args.dtype))
        model.to(device)
        workloads = default_workloads(
            processor,
            args.images,
            args.questions,
            args.unique,
            args.seed,
            names=names,
            num_system_prompts=args.system_prompts,
        )
        results = run_engine_benchmark(
            model,
            processor,
            workloads,
            args.batch_size,
            args.max_new_tokens,
            repeat=args.repeat,
            peers=running,
            num_kv_slots=args.num_kv_slots,
            page_size=args.page_size,
            prepack_weights=args.prepack_weights,
        )
        from minirad.bench.peer import report_threads

        threads = report_threads(running)
    print(format_report(results, threads))
    # A saved report must say how it was run: the dtype, a device other than the CPU, and
    # minirad without its prepacked weights (the memory and speed rows change with each).
    where = "" if device.type == "cpu" else f" on {device}"
    packed = "" if args.prepack_weights else "; minirad without prepacked weights"
    print(f"Each system's fastest of {args.repeat} runs, in {args.dtype}{where}{packed}.")
    differ = any(r.mismatches(x) for r in results for x in r.runs[1:])
    return int(differ and args.dtype == "float32")
