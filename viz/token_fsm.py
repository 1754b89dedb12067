"""A grammar as a state machine over tokens, explored through its mask, and drawn (chapter 09).

A grammar's state is the text accepted so far: two token sequences that spell the same text
(``'red'`` or ``'r' 'ed'``) lead to the same state, because the grammar reads bytes, not tokens.
:func:`explore_grammar` walks the states breadth first: in each one it asks the grammar for
its token bitmask (:meth:`minirad.engine.grammar.Grammar.fill_bitmask`) and follows every allowed
token. :func:`token_fsm_graph` draws the result: one circle per state, one arrow per allowed
token, the states where the mask allows exactly one token (jump-forward appends those without
asking the model, SGLang paper §4) in teal, the tokenizer's own tokenization of each complete
text in bold.

It only uses the grammar's public API (compile, accept, fill the mask), so it works for any
grammar :class:`~minirad.engine.grammar.GrammarCompiler` compiles; it is meant for small ones (a
choice list, a short regex): a JSON schema has too many states to draw.

Example::

    compiler = GrammarCompiler(tokenizer, vocab_size)
    fsm = explore_grammar(compiler, SamplingParams(choice=["red", "green"]), stop_token_ids=[2])
    token_fsm_graph(fsm, tokenizer)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minirad.engine.grammar import GrammarCompiler, allocate_token_bitmask
from minirad.engine.sampling_params import SamplingParams
from minirad.errors import InvalidArgumentError

if TYPE_CHECKING:
    import graphviz

__all__ = ["TokenStates", "allowed_token_ids", "explore_grammar", "token_fsm_graph"]

FORCED = "#00897b"  # viz.svg.FORCED: a state with one allowed token (jump-forward)


def allowed_token_ids(bitmask_row: Sequence[int], vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows: bit ``t % 32`` of word ``t // 32``, for ``t`` below
    ``vocab_size`` (``bitmask_row``: ``int32`` words, e.g. ``bitmask[0].tolist()``)."""
    return [t for t in range(vocab_size) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1]


@dataclass(frozen=True)
class TokenStates:
    """A grammar's states and the tokens its mask allows in each.

    Attributes:
        texts: the text of each state; state 0 is the start (``""``).
        edges: ``(state, token id, next state)`` for every allowed token; a stop token leads to
            ``-1`` (the request ends).
        paths: for each state, the first token sequence found that reaches it.
        complete: the texts explored fully (False: ``max_states`` cut the walk short).
    """

    texts: tuple[str, ...]
    edges: tuple[tuple[int, int, int], ...]
    paths: tuple[tuple[int, ...], ...]
    complete: bool

    def allowed(self, state: int) -> list[int]:
        """The token ids the mask allows in ``state``."""
        return [t for s, t, _ in self.edges if s == state]

    @property
    def forced_states(self) -> list[int]:
        """States whose mask allows exactly one token (jump-forward appends it)."""
        return [s for s in range(len(self.texts)) if len(self.allowed(s)) == 1]


def explore_grammar(
    compiler: GrammarCompiler,
    params: SamplingParams,
    stop_token_ids: Sequence[int],
    max_states: int = 60,
) -> TokenStates:
    """Walk ``params``' grammar state by state, breadth first, following every allowed token.

    Each state is reached by replaying a token path into a fresh grammar from ``compiler`` (a
    copy of the compiled one: :attr:`~minirad.engine.grammar.GrammarCompiler.num_cache_hits` grows
    by one per state).

    Raises:
        InvalidArgumentError: ``max_states`` < 1.
        GrammarError: the grammar does not compile.
    """
    if max_states < 1:
        raise InvalidArgumentError(f"max_states must be >= 1, got {max_states}")
    tokenizer, vocab = compiler.tokenizer, compiler.vocab_size
    stop = set(stop_token_ids)
    texts, paths, index = [""], [()], {"": 0}
    edges: list[tuple[int, int, int]] = []
    queue = deque([0])
    complete = True
    while queue:
        state = queue.popleft()
        grammar = compiler.compile(params, stop_token_ids)
        grammar.accept_tokens(paths[state])
        bitmask = allocate_token_bitmask(1, vocab)
        grammar.fill_bitmask(bitmask, 0)
        for t in allowed_token_ids(bitmask[0].tolist(), vocab):
            if t in stop:
                edges.append((state, t, -1))
                continue
            text = texts[state] + tokenizer.decode([t])
            if text not in index:
                if len(texts) >= max_states:
                    complete = False
                    continue
                index[text] = len(texts)
                texts.append(text)
                paths.append((*paths[state], t))
                queue.append(index[text])
            edges.append((state, t, index[text]))
    return TokenStates(tuple(texts), tuple(edges), tuple(paths), complete)


def token_fsm_graph(
    states: TokenStates, tokenizer, canonical: Sequence[str] = ()
) -> graphviz.Digraph:
    """The states as a left-to-right Graphviz drawing.

    Args:
        states: from :func:`explore_grammar`.
        tokenizer: to write each arrow's token (``'Ġ'`` shown as a space, quoted).
        canonical: complete texts whose tokenizer tokenization (``tokenizer.encode``) is drawn
            bold: the one path the tokenizer would take among all the mask allows.
    """
    from minirad.course.dot import digraph, escape

    bold = set()
    for text in canonical:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for i in range(len(ids)):
            bold.add((tokenizer.decode(ids[:i]), ids[i]))
    dot = digraph(
        "token_fsm",
        graph_attr={"rankdir": "LR", "nodesep": "0.15", "ranksep": "0.35"},
        node_attr={"shape": "circle", "fontsize": "10", "width": "0.3", "margin": "0.02"},
        edge_attr={"fontsize": "10", "arrowsize": "0.6"},
    )
    forced = set(states.forced_states)
    for i, text in enumerate(states.texts):
        label = escape(repr(text)) if text else "start"
        style = {"style": "filled", "fillcolor": "#b2dfdb", "color": FORCED} if i in forced else {}
        dot.node(str(i), label, **style)
    if any(to == -1 for _, _, to in states.edges):
        dot.node("end", "end", shape="doublecircle")
    for state, t, to in states.edges:
        token = tokenizer.decode([t])
        if to == -1:
            dot.edge(
                str(state), "end", label=escape(tokenizer.convert_ids_to_tokens(t)), style="dashed"
            )
            continue
        width = {"penwidth": "2.2"} if (states.texts[state], t) in bold else {}
        dot.edge(str(state), str(to), label=escape(repr(token)), **width)
    return dot
