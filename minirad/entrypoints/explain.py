"""``minirad explain TRACE.jsonl``: why each request of a trace hit or missed the cache (the
command's work; its parser is :mod:`minirad.entrypoints.commands.explain`).

Each line of the trace is ``{"prompt_token_ids": [...]}`` or ``{"messages": [...]}`` (OpenAI
chat messages, images as ``image_url`` parts: data URLs or paths relative to the trace's
folder), rendered with ``--model``'s chat template and processor (no weights are loaded).
The requests are replayed one at a time through a radix or block cache
(:func:`~minirad.kv_events.explain_trace.explain_trace`); the command prints the prompt tokens
per cause, the requests that missed most and why, or with ``--json`` one line per request.
The report names requests r1, r2, ... in the trace's order (chapter 08's names); a JSON line's
``"request"`` counts from 0, as do the ``by_request`` of its runs, and its ``"label"`` is r1...

``minirad explain --from-recording PATH`` reads a real vLLM or SGLang session instead
(``PATH_outputs.json``, ``PATH_events.jsonl``, e.g. ``data/recordings/vllm_ch08``): no replay,
the server's KV events and each response's ``cached_tokens``
(:mod:`~minirad.kv_events.explain_events`); what they cannot explain is ``unknown``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from minirad.errors import ImageError, InvalidArgumentError, RequestError
from minirad.kv_events.miss_causes import describe_fork, label, span

__all__ = ["format_report", "load_trace", "run_explain"]


def _messages_prompt(line: dict, where: str, processor, media) -> tuple[str, list]:
    """A chat line's prompt text and images, as a server would build them."""
    from minirad.entrypoints.chat_utils import chat_template, image_from_url

    messages, images = [], []
    for m in line["messages"]:
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError(f"{where}: each message needs a 'role'")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = str(url.get("url", "") if isinstance(url, dict) else url)
                    name = url.removeprefix("file://")
                    local = url and not url.startswith("data:") and "://" not in name
                    if local and not Path(name).is_absolute():
                        url = str(media.path / name)  # relative to the trace's folder
                    images.append(image_from_url(url, media))
                    parts.append({"type": "image"})
                else:
                    raise RequestError(f"{where}: a content part of type {kind!r}")
            content = parts
        messages.append({"role": m["role"], "content": content})
    return chat_template(processor, messages), images


def load_trace(path: str | Path, model: str | None = None) -> tuple[list[list[int]], int | None]:
    """The trace's prompts as radix keys (images as their pad ids), and the vocabulary size
    when a model was needed (None for token-id lines only).

    Raises:
        InvalidArgumentError: the file cannot be read, or a line is not one of the two forms.
        RequestError, ImageError: a chat line the model's processor refuses.
    """
    path = Path(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would wait for a writer forever
            raise InvalidArgumentError(f"{path} is not a regular file")
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read {path}: {e}") from None
    processor = media = None
    prompts: list[list[int]] = []
    id_lines: list[tuple[str, int]] = []  # (file:line, its largest id)
    vocab_size = None
    for number, text in enumerate(lines, start=1):
        where = f"{path}:{number}"
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError as e:
            raise InvalidArgumentError(f"{where}: not JSON ({e})") from None
        if not isinstance(line, dict):
            raise InvalidArgumentError(f"{where}: a line must be a JSON object")
        if "prompt_token_ids" in line:
            ids = line["prompt_token_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(type(t) is int and t >= 0 for t in ids)
            ):
                raise InvalidArgumentError(
                    f"{where}: 'prompt_token_ids' must be a non-empty list of ints >= 0"
                )
            prompts.append(ids)
            id_lines.append((where, max(ids)))
        elif isinstance(line.get("messages"), list):
            if processor is None:
                processor, media = _chat_processor(model, path.parent)
                vocab_size = processor.vocab_size
            try:
                prompt, images = _messages_prompt(line, where, processor.processor, media)
                prompts.append(processor.process(prompt, images).key_ids)
            except (RequestError, ImageError) as e:
                message = str(e)
                raise type(e)(message if message.startswith(where) else f"{where}: {e}") from None
        else:
            raise InvalidArgumentError(
                f"{where}: a line needs 'prompt_token_ids' (a list) or 'messages' (a list)"
            )
    if not prompts:
        raise InvalidArgumentError(f"{path}: no requests")
    for where, top in id_lines:  # beside chat lines, ids at or above it would read as images
        if vocab_size is not None and top >= vocab_size:
            raise InvalidArgumentError(
                f"{where}: token id {top} is outside the model's vocabulary ({vocab_size})"
            )
    return prompts, vocab_size


def _chat_processor(model: str | None, folder: Path):
    """The model's input processor (tokenizer, chat template, image processor), without its
    weights."""
    from transformers import AutoConfig, AutoProcessor

    from minirad.engine.media import MediaFolder
    from minirad.engine.processing import InputProcessor
    from minirad.models import DEFAULT_MODEL_DIR, get_family

    model = model or str(DEFAULT_MODEL_DIR)
    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
        processor = AutoProcessor.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"--model {model!r}: cannot load its processor: {e}") from None
    family = get_family(config)
    text = getattr(config, "text_config", config)
    return (
        InputProcessor(processor, config.image_token_id, text.vocab_size, family.image_input_names),
        MediaFolder(folder),
    )


def format_report(explained, totals: dict[str, int], worst: int = 5) -> str:
    """Tokens per cause, the hit rate, and the ``worst`` requests by tokens missed."""
    prompt = sum(e.num_tokens for e in explained)
    lines = [f"{len(explained)} requests, {prompt:,} prompt tokens", ""]
    width = max(map(len, totals))
    for cause, n in totals.items():
        share = n / prompt if prompt else 0.0
        lines.append(f"  {cause:<{width}}  {n:>10,}  {share:6.1%}")
    lines += ["", f"hit rate {totals['hit'] / prompt:.1%}" if prompt else "hit rate -"]
    missed = sorted(explained, key=lambda e: e.tokens("hit") - e.num_tokens)[:worst]
    if missed and missed[0].num_tokens > missed[0].tokens("hit"):
        lines += ["", f"requests that missed most (of {len(explained)}):"]
        for e in missed:
            if e.num_tokens == e.tokens("hit"):
                break
            runs = ", ".join(
                f"{span(r.start, r.end)} {r.cause}{_detail(r.detail)}"
                for r in e.runs
                if r.cause != "hit"
            )
            lines.append(f"  {label(e.request)}: {e.num_tokens - e.tokens('hit'):,} missed: {runs}")
    return "\n".join(lines)


def _detail(detail: dict) -> str:
    if "by_request" in detail:
        n = detail.get("min_kept")
        kept = f"; MIN would have served {n:,} of them" if n else ""
        return (
            f" (by {label(detail['by_request'])} at tick {detail['time']}, {detail['policy']}"
            f"{kept})"
        )
    if "at" in detail:
        if not detail["seen_next"]:
            if not detail["at"]:
                return " (no earlier prompt)"
            return f" (earlier prompts ended before token {detail['at']})"
        return f" ({describe_fork(detail)})"
    if "seq" in detail:  # a real server's removal (explain_events)
        cleared = ", all blocks cleared" if detail.get("cleared") else ""
        return f" (removed in event batch seq {detail['seq']}, ts {detail['ts']}{cleared})"
    if "why" in detail:
        return f" ({detail['why']})"
    if "one_of" in detail:
        return f" (one of {detail['one_of']})"
    if "events_support" in detail:
        return f" (the events support {detail['events_support']})"
    return ""


def run_explain(args, out=print) -> int:
    """The ``explain`` command: replay (or, with ``--from-recording``, read a real server's
    events and cached tokens), then the report (or one JSON line per request).

    Raises:
        InvalidArgumentError: neither or both of a trace and ``--from-recording``.
    """
    from minirad.kv_events.explain_trace import totals

    recording = getattr(args, "from_recording", None)
    if (args.trace is None) == (recording is None):
        raise InvalidArgumentError("give a trace or --from-recording PATH (one of them)")
    best = None
    if recording is not None:
        from minirad.kv_events import explain_events

        explained = explain_events.explain_recording(recording)
        by_cause = explain_events.totals(explained)
    else:
        explained, best = _replay(args)
        by_cause = totals(explained)
    if args.json:
        # "request" counts from 0 (backward compatible); "label" names it as the report does.
        for e in explained:
            out(json.dumps({"request": e.request, "label": label(e.request), **e.to_dict()}))
    else:
        report = format_report(explained, by_cause)
        if best is not None:
            evicted = [r for e in explained for r in e.runs if r.cause == "evicted"]
            kept = sum(r.detail.get("min_kept", 0) for r in evicted)
            report += (
                f"\nBelady's MIN (the best any eviction could do), same order and capacity: hit "
                f"rate {best.hit_rate:.1%}; of the {by_cause['evicted']:,} "
                f"evicted tokens, MIN would have served {kept:,}"
            )
        out(report)
    return 0


def _replay(args) -> tuple[list, object]:
    """The trace's requests replayed through the command's cache, and Belady's MIN on them
    (pages of the cache's page or block size)."""
    from minirad.kv_events.explain_trace import check_trace, explain_trace, optimal

    prompts, vocab_size = load_trace(args.trace, args.model)
    prompts = check_trace(prompts, args.cache, args.capacity, args.page_size, args.block_size)
    unit = args.page_size if args.cache == "radix" else args.block_size
    best = optimal(prompts, args.capacity, unit)
    explained = explain_trace(
        prompts,
        cache=args.cache,
        capacity=args.capacity,
        page_size=args.page_size,
        block_size=args.block_size,
        policy=args.radix_eviction_policy,
        vocab_size=vocab_size,
        min_hits=best.request_hit_tokens,
    )
    return explained, best
