"""The course's tokenizer: a small byte-level BPE, trained here and shipped in ``data/tokenizer/``.

Radix and paged KV caches key their entries on *token ids*, so every chapter needs a tokenizer
that is small (ids short enough to print), deterministic (printed ids are compared by nbval)
and loadable offline. We train our own instead of downloading one:

- Byte-level BPE, as in GPT-2 (Radford et al. 2019, "Language Models are Unsupervised
  Multitask Learners", §2.2): every byte is in the base vocabulary, so any string, including
  unicode, round-trips exactly; merges learned from ``data/tokenizer/corpus.txt`` make the
  course's common words single tokens.
- Trained with Hugging Face ``tokenizers`` (``models.BPE``, ``trainers.BpeTrainer``,
  ``pre_tokenizers.ByteLevel``; https://huggingface.co/docs/tokenizers/quicktour) and wrapped
  in ``transformers.PreTrainedTokenizerFast`` so ``apply_chat_template`` and
  ``save_pretrained`` / ``from_pretrained`` work as for any HF model.
- ChatML turns (``<|im_start|>role\\ncontent<|im_end|>\\n``), the format used by Qwen and
  SGLang's chat templates (https://huggingface.co/docs/transformers/main/en/chat_templating).
- ``<image>`` is the placeholder that the VLM chapters expand into image-patch positions
  (``image_token_id``, as in HF LLaVA-style processors).

Retrain with ``python -m minirad.models.tokenizer`` (rewrites ``data/tokenizer/``); the tests check
that retraining reproduces the committed ``tokenizer.json`` byte for byte.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_CORPUS",
    "DEFAULT_TOKENIZER_DIR",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "load_tokenizer",
    "read_corpus",
    "train_tokenizer",
]

# data/ lives at the repository top level and is read by path (minirad/../data/tokenizer).
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "data" / "tokenizer"
DEFAULT_CORPUS = DEFAULT_TOKENIZER_DIR / "corpus.txt"
DEFAULT_VOCAB_SIZE = 1024

EOS_TOKEN = "<|endoftext|>"  # also the padding token
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_TOKEN = "<image>"
# Listed first to the trainer, so their ids are 0, 1, 2, 3 in this order.
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, IMAGE_TOKEN)

# ChatML, with the generation prompt that opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(
    texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (one training sequence per string).

    Deterministic: the same texts and vocab_size give the same ``tokenizer.json``
    (``BpeTrainer`` breaks ties between equally frequent pairs by the pair itself).
    No normalizer, so ``decode(encode(s)) == s`` for every string ``s``; no BOS/EOS is added
    by ``encode``. Raises ValueError if the texts are too small to reach ``vocab_size``.
    """
    base = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= base:
        raise ValueError(f"vocab_size must exceed {base} (special tokens + 256 bytes)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"corpus too small: BPE stopped at {tokenizer.get_vocab_size()} tokens "
            f"(asked for {vocab_size}); add text or lower vocab_size"
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        image_token=IMAGE_TOKEN,  # exposes tokenizer.image_token / tokenizer.image_token_id
        extra_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # keep decode(encode(s)) == s
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def load_tokenizer(path: str | Path = DEFAULT_TOKENIZER_DIR) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved with ``save_pretrained`` from a local directory (never the Hub)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}; run `python -m minirad.models.tokenizer` to create it"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def read_corpus(path: str | Path = DEFAULT_CORPUS) -> list[str]:
    """The training texts: the non-empty lines of the corpus file."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip()]


def main() -> None:
    tokenizer = train_tokenizer(read_corpus(DEFAULT_CORPUS))
    tokenizer.save_pretrained(str(DEFAULT_TOKENIZER_DIR))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    print(f"saved {len(tokenizer)}-token tokenizer to {DEFAULT_TOKENIZER_DIR}; special ids {ids}")


if __name__ == "__main__":
    main()
