"""A text chat workload on the shipped model's tokenizer: shared system prompts, multi-turn
conversations, and branches.

The workload is a script of :class:`Turn` s. A turn either opens a conversation (one of a few
system prompts, shared by many conversations, and a first question) or continues an earlier
turn: its prompt is that turn's prompt and answer, as the model gave it, then a new question.
Two turns that continue the same turn are branches (the user asks again, differently), so the
prefix tree of the prompts forks inside conversations as well as after the system prompts.
Conversations overlap in time, a few open at once, so a small KV pool must choose whom to evict.

The ids of a continued prompt depend on the answers, so the script is run against a model
(:func:`run_turns`): the real SGLang, our engine, anything that answers token ids. Turns are
ChatML token ids of ``data/models/minirad-tiny-llava``'s tokenizer; everything is drawn from
one ``random.Random(seed)``: the same arguments give the same script.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from minirad.errors import InvalidArgumentError
from minirad.peers.text_model import DEFAULT_LLAVA_DIR

__all__ = ["SYSTEM_PROMPTS", "Answer", "Turn", "chat_turns", "run_turns"]

# The first is the common one (half the conversations): the hot prefix a cache should keep.
SYSTEM_PROMPTS = (
    "You are a helpful assistant that answers questions about images. The images show simple "
    "scenes of coloured shapes: circles, squares and triangles, in red, green, blue and yellow. "
    "Answer briefly and truthfully.",
    "You are a concise assistant. Reply with one word when you can.",
    "You are a careful assistant. Describe what you see, from left to right and from top to "
    "bottom, then answer the question. Do not guess: if you cannot see it, say so.",
)
QUESTIONS = (
    "Describe the image.",
    "What colour is the circle?",
    "Is there a square?",
    "How many shapes are there?",
    "What is left of the triangle?",
    "Is the red shape above the blue one?",
    "Describe the scene in one sentence.",
    "What shape is green?",
    "Thanks! And what is on the right?",
    "Can you say that again, shorter?",
)
MAX_NEW_TOKENS = (2, 4, 24)  # 2 and 4 cut many answers (a length finish), 24 lets them stop


class Turn(NamedTuple):
    """One request of the script.

    Attributes:
        rid: ``"c{conversation}t{turn}"``, plus ``"b"`` for each later branch of that turn.
        after: index of the earlier turn whose prompt and answer this one continues; None
            opens a conversation.
        system: the conversation's system prompt (index into :data:`SYSTEM_PROMPTS`).
        question: the user's new message.
        max_new_tokens: the request's output budget.
    """

    rid: str
    after: int | None
    system: int
    question: str
    max_new_tokens: int


class Answer(NamedTuple):
    """A turn as a model answered it: its ``rid`` and ``after`` (as in :class:`Turn`), prompt
    ids, output ids (a stop token included), ``max_new_tokens``, ``stopped`` (ended on a stop
    token rather than on ``max_new_tokens``) and the server's ``cached_tokens`` (None where it
    does not say)."""

    rid: str
    after: int | None
    prompt: list[int]
    output: list[int]
    max_new_tokens: int
    stopped: bool
    cached_tokens: int | None


def chat_turns(
    num_conversations: int = 10,
    seed: int = 0,
    *,
    max_turns: int = 4,
    branch_p: float = 0.3,
    open_at_once: int = 3,
) -> list[Turn]:
    """The script: ``num_conversations`` conversations of 1 to ``max_turns`` turns (a branch
    adds one), about ``open_at_once`` open at a time, their turns interleaved at random.

    Raises:
        InvalidArgumentError: a count is not a positive int, ``branch_p`` not in [0, 1].
    """
    for name, v in dict(
        num_conversations=num_conversations, max_turns=max_turns, open_at_once=open_at_once
    ).items():
        if type(v) is not int or v < 1:
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    if not 0 <= branch_p <= 1:
        raise InvalidArgumentError(f"branch_p must be in [0, 1], got {branch_p!r}")
    rng = random.Random(seed)
    turns: list[Turn] = []
    ready: list[tuple[int, int | None, int, int, int]] = []  # conv, after, depth, system, depth cap
    rids: set[str] = set()
    opened = 0
    while opened < num_conversations or ready:
        if opened < num_conversations and len({r[0] for r in ready}) < open_at_once:
            system = 0 if rng.random() < 0.5 else rng.randrange(1, len(SYSTEM_PROMPTS))
            ready.append((opened, None, 0, system, rng.randint(1, max_turns)))
            opened += 1
            continue
        conv, after, depth, system, cap = ready.pop(rng.randrange(len(ready)))
        rid = f"c{conv}t{depth}"
        while rid in rids:
            rid += "b"
        rids.add(rid)
        turns.append(Turn(rid, after, system, rng.choice(QUESTIONS), rng.choice(MAX_NEW_TOKENS)))
        if depth + 1 < cap:
            ready.append((conv, len(turns) - 1, depth + 1, system, cap))
            if rng.random() < branch_p:
                ready.append((conv, len(turns) - 1, depth + 1, system, cap))
    return turns


def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEFAULT_LLAVA_DIR / "tokenizer.json"))


def run_turns(
    turns: Sequence[Turn], generate: Callable[[list[int], int], tuple[list[int], bool, int | None]]
) -> list[Answer]:
    """Send the turns one at a time, in order, to ``generate(prompt_ids, max_new_tokens) ->
    (output_ids, stopped, cached_tokens or None)``, each prompt built from the answers before.

    A conversation is ChatML: ``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...
    <|im_end|>\\n<|im_start|>assistant\\n``, and a continued turn appends ``<|im_end|>`` (unless
    the answer ended with it), then the next user message and the assistant's header.
    """
    tok = _tokenizer()
    im_end = tok.token_to_id("<|im_end|>")
    ask = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    answers: list[Answer] = []
    for turn in turns:
        if turn.after is None:
            system = f"<|im_start|>system\n{SYSTEM_PROMPTS[turn.system]}<|im_end|>\n"
            prompt = tok.encode(system + ask.format(turn.question)).ids
        else:
            prev = answers[turn.after]
            close = [] if prev.output[-1:] == [im_end] else [im_end]
            prompt = (
                prev.prompt + prev.output + close + tok.encode("\n" + ask.format(turn.question)).ids
            )
        output, stopped, cached = generate(prompt, turn.max_new_tokens)
        answers.append(
            Answer(
                turn.rid,
                turn.after,
                prompt,
                list(output),
                turn.max_new_tokens,
                bool(stopped),
                cached,
            )
        )
    return answers
