"""Tokenizers through Hugging Face `tokenizers`: train a byte-level BPE on the corpus, load a
tokenizer.json, or use a Hugging Face model directory's own (its tokenizer.json, and the model's
BOS and EOS), and frame each document the way its model expects."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.errors import ConfigError
from strata.files import read_json_object

END_OF_TEXT = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A GPT-2-style byte-level BPE: every byte is in the alphabet, so any text encodes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)


@dataclass(frozen=True)
class DocumentTokenizer:
    """A tokenizer and how it frames a document: `prefix` before it (the model's BOS when its
    tokenizer adds one), `end_of_text` after it (None: nothing), and the vocabulary the ids index
    (a model's embedding may have more rows than its tokenizer has tokens)."""
    tokenizer: Tokenizer
    prefix: tuple[int, ...]
    end_of_text: int | None
    vocab_size: int
    add_special_tokens: bool = True  # let the tokenizer's own post-processor run (strata's add nothing)

    def encode(self, texts: list[str]) -> list[list[int]]:
        suffix = [self.end_of_text] if self.end_of_text is not None else []
        return [[*self.prefix, *encoding.ids, *suffix]
                for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=self.add_special_tokens)]


def document_tokenizer(spec: str, texts: list[str]) -> DocumentTokenizer:
    """`bpe:N` (trained on the texts), a tokenizer.json, or a Hugging Face model directory."""
    if spec.startswith("bpe:"):
        size = spec[4:]
        if not size.isdigit() or not 257 <= int(size) <= 1 << 20:
            raise ConfigError(f"--tokenizer {spec}: want bpe:N with N from 257 to 1048576")
        return _plain(train_bpe(texts, int(size)))
    if os.path.isdir(spec):
        return model_tokenizer(spec)
    if spec.endswith(".json") and os.path.isfile(spec):
        return _plain(read_tokenizer(spec, f"--tokenizer {spec}"))
    raise ConfigError(f"--tokenizer {spec}: want bpe:N, the path of a tokenizer.json, or a Hugging Face model "
                      f"directory holding one")


def _plain(tokenizer: Tokenizer) -> DocumentTokenizer:
    """strata's own framing: each document followed by <|endoftext|> when the vocabulary has it."""
    return DocumentTokenizer(tokenizer, (), tokenizer.token_to_id(END_OF_TEXT), tokenizer.get_vocab_size())


def read_tokenizer(path: str, where: str, error: type[Exception] = ConfigError) -> Tokenizer:
    """A tokenizer.json, or one line: `where` (the flag and value that named it) and tokenizers' reason."""
    try:
        return load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a bad file
        raise error(f"{where}: not a tokenizer.json that `tokenizers` reads "
                    f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None


# --- a Hugging Face model's tokenizer --------------------------------------------------------------
def model_tokenizer(directory: str) -> DocumentTokenizer:
    """A model directory's tokenizer.json, with its model's framing: the model's EOS after every
    document (config.json's eos_token_id, the first of a list; else tokenizer_config.json's
    eos_token), and before it what the tokenizer puts before a text (Llama's and Gemma's BOS;
    Qwen's nothing), or BOS as tokenizer_config.json's add_bos_token says when it says so."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--tokenizer {directory}: the directory has no tokenizer.json")
    tokenizer = read_tokenizer(path, f"--tokenizer {directory}")
    config = _optional_json(directory, "config.json")
    tokenizer_config = _optional_json(directory, "tokenizer_config.json")
    eos = _special_id(tokenizer, config.get("eos_token_id"), tokenizer_config.get("eos_token"))
    if eos is None:
        raise ConfigError(f"--tokenizer {directory}: no end-of-text token (eos_token_id in config.json or "
                          f"eos_token in tokenizer_config.json)")
    prefix = _prefix(tokenizer)
    if isinstance(tokenizer_config.get("add_bos_token"), bool):
        bos = _special_id(tokenizer, config.get("bos_token_id"), tokenizer_config.get("bos_token"))
        prefix = (bos,) if tokenizer_config["add_bos_token"] and bos is not None else ()
    vocab_size = max(tokenizer.get_vocab_size(), config.get("vocab_size") or 0)  # the embedding's rows
    return DocumentTokenizer(tokenizer, prefix, eos, vocab_size, add_special_tokens=False)


def _optional_json(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    return read_json_object(path, f"a Hugging Face {name}") if os.path.isfile(path) else {}


def _special_id(tokenizer: Tokenizer, given_id, token) -> int | None:
    """An id given as a number (or the first of a list), else the id of a token given by its text
    (a string, or {"content": ...} as tokenizer_config.json writes added tokens)."""
    if isinstance(given_id, list):
        given_id = given_id[0] if given_id else None
    if isinstance(given_id, int) and not isinstance(given_id, bool):
        return given_id
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def _prefix(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids the tokenizer's post-processor puts before a text (its template's BOS)."""
    framed, plain = tokenizer.encode("a").ids, tokenizer.encode("a", add_special_tokens=False).ids
    for start in range(len(framed) - len(plain) + 1):
        if framed[start:start + len(plain)] == plain:
            return tuple(framed[:start])
    return ()
