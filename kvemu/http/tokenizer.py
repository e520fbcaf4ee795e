"""Text ↔ token ids for the OpenAI front end: a built-in deterministic tokenizer, or any local ``tokenizer.json``.

The built-in one needs no download and is a plain Hugging Face ``tokenizers`` model, so ``kvemu tokenizer
export DIR`` hands benchmark clients (aiperf, ``vllm bench serve``) exactly the tokenizer kvemu counts
with. Text is lower-cased and accents stripped; it splits at whitespace, every punctuation character is a
token, and each run of letters and digits is cut into pieces of at most 3 characters, each one token
(``"Hello, world"`` → ``hel lo , wor ld``). Its vocabulary is every such piece (48,026 entries with the
special tokens), so distinct ASCII texts get distinct ids and the same text always the same ids; other
characters are ``<unk>``. Output text is made of vocabulary pieces joined by spaces, so re-tokenizing a
response gives back exactly the tokens the engine produced (and a next turn that quotes it hits the cache).
"""

from __future__ import annotations

import functools
import math
import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import xxhash
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from kvemu.errors import InvalidArgument

__all__ = ["TextTokenizer", "builtin_tokenizer", "load_tokenizer", "export_builtin", "ROLES", "BUILTIN_NAME"]

BUILTIN_NAME = "kvemu-words"
ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles the prompt template knows (OpenAI's, less the deprecated ``function``)."""
_SPECIALS = ["<unk>", "<|endoftext|>", *(f"<|{r}|>" for r in ROLES), "<|end|>"]
_ALNUM = string.digits + string.ascii_lowercase
_PIECE = r"[a-z0-9]{1,3}|[^a-z0-9\s]"
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}\n{% endif %}{% endfor %}{% endif %}"
    " <|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The same prompt ``TextTokenizer.chat_prompt`` builds, as a Jinja template for exported tokenizers."""
_MAX_OUTPUT_CANDIDATES = 65_536
_NOT_COUNTED = bytes(range(0x80, 0x100)) + b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"
"""UTF-8 bytes ``min_tokens`` does not count: every byte of a non-ASCII character, and ASCII whitespace (and the
separators Python calls space: erring towards fewer counted characters keeps the bound a lower one)."""


class TextTokenizer:
    """What the HTTP layer needs from a tokenizer: encode, decode, a chat prompt, the text of output tokens."""

    def __init__(self, tok: Tokenizer, name: str, *, piece_chars: int | None = None) -> None:
        self.tok = tok
        self.name = name
        self.piece_chars = piece_chars
        """The most ASCII characters one token other than a special token covers (3 for the built-in
        tokenizer), which makes ``min_tokens`` a real bound; ``None`` for a tokenizer.json (no such bound)."""
        self._specials = [t.content for t in tok.get_added_tokens_decoder().values()]
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = tok.token_to_id("<|endoftext|>")
        self._pieces, self._piece_ids = self._output_candidates()
        k = len(self._pieces)
        self._cycle: tuple[list[str], list[int], int] | None = None
        """Outputs walk the pieces ``_STRIDE`` apart: that walk laid out once (texts, ids, and the inverse of
        the stride modulo their count), so a request's plan is a slice of it, copied in C, not a loop a token."""
        if math.gcd(_STRIDE, k) == 1:
            order = [(_STRIDE * i) % k for i in range(k)]
            self._cycle = [self._pieces[j] for j in order], [self._piece_ids[j] for j in order], pow(_STRIDE, -1, k)

    def _output_candidates(self) -> tuple[list[str], list[int]]:
        """Token texts that re-tokenize to themselves alone, also when joined by spaces: what outputs are made of."""
        tok = self.tok
        vocab = sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
        words = [(i, tok.decode([i])) for _, i in vocab[:_MAX_OUTPUT_CANDIDATES]]
        words = [(i, w.strip()) for i, w in words if w.strip().isascii() and w.strip().isalpha()]
        encoded = tok.encode_batch([" " + w for _, w in words], add_special_tokens=False)
        kept = [(" " + w, i) for (i, w), e in zip(words, encoded) if e.ids == [i]]
        if not kept:
            raise InvalidArgument(f"tokenizer {self.name}: no token re-tokenizes to itself; it cannot produce output")
        return [w for w, _ in kept], [i for _, i in kept]

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` computed without tokenizing (a few passes of C over the text):
        with the built-in tokenizer each ASCII character that is not whitespace stays one character through the
        normalizer (NFKD leaves ASCII alone and composes nothing; only combining marks are stripped) and lies in
        exactly one token, which covers at most ``piece_chars`` of them unless it is a special token; so
        ``ceil((ascii_non_space - chars_in_special_tokens) / piece_chars)``. 0 for other tokenizers."""
        if self.piece_chars is None:
            return 0
        n = len(text.encode("utf-8", "surrogatepass").translate(None, _NOT_COUNTED))
        n -= sum(text.count(s) * len(s) for s in self._specials)
        return max(0, -(-n // self.piece_chars))

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each text, in one call (a third cheaper per text than ``encode`` one by one)."""
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; ``InvalidArgument`` naming the first id outside the vocabulary."""
        self.check_ids(ids)
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def check_ids(self, ids: Sequence[int], field: str | None = None) -> None:
        """``InvalidArgument`` (naming ``field``) when an id is outside the vocabulary."""
        n = self.vocab_size
        if not ids or (min(ids) >= 0 and max(ids) < n):  # two passes in C: a prompt of ids may be millions long
            return
        for i in ids:
            if not 0 <= i < n:
                where = f"{field}: " if field else ""
                raise InvalidArgument(f"{where}token id {i} is outside the vocabulary (0..{n - 1})")

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        """The prompt text of a conversation (role, text) with the generation prompt appended."""
        parts = [f"<|{role}|> {text} <|end|>" for role, text in messages]
        parts.append("<|assistant|>")
        return " ".join(parts)

    def output(self, request_id: str, n: int) -> tuple[list[int], list[str]]:
        """The ``n`` output token ids of a request and their texts (each with its leading space): a
        deterministic function of the request id, so a run can be repeated."""
        pieces, piece_ids = self._pieces, self._piece_ids
        k = len(pieces)
        start = xxhash.xxh3_64_intdigest(request_id.encode()) % k
        if self._cycle is not None:  # piece (start + STRIDE * i) % k is the walk's entry (start / STRIDE + i) % k
            texts, ids, inverse = self._cycle
            at = start * inverse % k
            return _cyclic(ids, at, n), _cyclic(texts, at, n)
        picks = [(start + _STRIDE * i) % k for i in range(n)]
        return [piece_ids[j] for j in picks], [pieces[j] for j in picks]


_STRIDE = 7919
"""Consecutive output tokens are this many pieces apart (a prime: the walk visits every piece)."""

_T = TypeVar("_T")


def _cyclic(seq: list[_T], at: int, n: int) -> list[_T]:
    """``n`` entries of ``seq`` read cyclically from ``at``."""
    out = seq[at:at + n]
    while len(out) < n:
        out += seq[:n - len(out)]
    return out


def _build_builtin() -> Tokenizer:
    vocab: dict[str, int] = {}
    for piece in _SPECIALS:
        vocab[piece] = len(vocab)
    for c in string.punctuation:
        vocab[c] = len(vocab)
    for a in _ALNUM:
        vocab[a] = len(vocab)
    for a in _ALNUM:
        for b in _ALNUM:
            vocab[a + b] = len(vocab)
    for a in _ALNUM:
        for b in _ALNUM:
            for c in _ALNUM:
                vocab[a + b + c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()])
    # the pieces are the matches; whitespace between them is dropped (one regex pass: the cheapest split)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE), behavior="removed", invert=True)
    tok.add_special_tokens(_SPECIALS)
    return tok


@functools.cache
def builtin_tokenizer() -> TextTokenizer:
    """The built-in tokenizer (built once per process, in about 0.1 s)."""
    return TextTokenizer(_build_builtin(), BUILTIN_NAME, piece_chars=3)


def load_tokenizer(path: str | Path | None) -> TextTokenizer:
    """The built-in tokenizer (``None``), or a local ``tokenizer.json`` (a file, or a directory holding one)."""
    if path is None:
        return builtin_tokenizer()
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise InvalidArgument(f"tokenizer: {p} is not a tokenizer.json file (or a directory holding one)")
    if p.stat().st_size > 256 << 20:
        raise InvalidArgument(f"tokenizer: {p} is larger than 256 MiB")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions for bad files
        raise InvalidArgument(f"tokenizer: {p} is not a Hugging Face tokenizer.json: {exc}") from None
    return TextTokenizer(tok, str(p))


def export_builtin(directory: str | Path, *, model_max_length: int = 131_072) -> list[Path]:
    """Write the built-in tokenizer as a Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained``
    loads it); returns the files written."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = builtin_tokenizer().tok
    files = {
        "tokenizer.json": tok.to_str(pretty=False),
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
            "unk_token": "<unk>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "clean_up_tokenization_spaces": False, "chat_template": _CHAT_TEMPLATE,
        }, indent=2),
        "special_tokens_map.json": json.dumps({"unk_token": "<unk>", "eos_token": "<|endoftext|>",
                                               "pad_token": "<|endoftext|>"}, indent=2),
        "config.json": json.dumps({"model_type": "llama", "vocab_size": tok.get_vocab_size(),
                                   "max_position_embeddings": model_max_length}, indent=2),
    }
    written = []
    for name, text in files.items():
        (d / name).write_text(text + "\n")
        written.append(d / name)
    return written
