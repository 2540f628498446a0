"""A real small tokenizer for the built models: a byte-level BPE trained offline, plus a chat template.

The ``small`` and ``medium`` models are random weights with no published tokenizer. So that text
prompts, chat and the OpenAI client work on them end to end, :func:`save_tokenizer` trains a
byte-level BPE (GPT-2's scheme: every byte is a token, so any text encodes) with ``tokenizers`` on
the short English text the package carries (``runahead/data/text/corpus.txt``), wraps it in
``transformers.PreTrainedTokenizerFast`` with a ChatML chat template, and saves it into the model
folder. Nothing is downloaded; training takes well under a second.
"""

from __future__ import annotations

import itertools
import json
from importlib import resources
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1, 2: padding, the start of a chat turn, and the end of a turn (the model's end of sequence)."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML, the turn format of Qwen's chat models."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
"""Files one of which a model folder needs for ``transformers.AutoTokenizer`` to load a real vocabulary."""


def corpus() -> str:
    """The training text shipped with the package."""
    return resources.files("runahead").joinpath("data", "text", "corpus.txt").read_text(encoding="utf-8")


def has_tokenizer(path: str | Path) -> bool:
    """Whether the model folder holds tokenizer files (else ``transformers`` would load an empty one).

    A ``.gguf`` file counts when its metadata has a vocabulary (``tokenizer.ggml.tokens``).
    """
    if str(path).endswith(".gguf") and Path(path).is_file():
        from runahead.models.gguf import GGUFModel

        return "tokenizer.ggml.tokens" in GGUFModel(path).fields
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def save_tokenizer(path: str | Path, vocab_size: int) -> None:
    """Train the byte-level BPE (``vocab_size`` tokens) and save it with the chat template to ``path``.

    Called by the model builders of :mod:`runahead.medium`; the end of a turn ``<|im_end|>`` has id 2,
    the builders' ``eos_token_id``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs at least 259 tokens, got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus().splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=_filled(bpe, vocab_size),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(str(path))


def _filled(bpe: Any, vocab_size: int) -> Any:
    """``bpe`` with its vocabulary filled up to ``vocab_size`` by pairs of its words.

    A small text teaches far fewer tokens than a model's vocabulary (1.3 k of 4 k here), and a
    random model emits any id. Every id past the trained ones decodes to two trained words (" the"
    + " cat"), so whatever the model emits prints as text. No merge produces these tokens, so
    encoding never uses them: it stays the trained BPE.
    """
    from tokenizers import Tokenizer

    data = json.loads(bpe.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    words = sorted((t for t in vocab if t.startswith("\u0120") and len(t) > 2), key=vocab.__getitem__)
    pairs = (a + b for a in words for b in words if a != b)
    for token in itertools.islice((p for p in pairs if p not in vocab), max(0, vocab_size - len(vocab))):
        vocab[token] = len(vocab)
    return Tokenizer.from_str(json.dumps(data))
