"""The tokenizers: token ids to text (and text to ids, for hotwords), as funasr's
SentencepiecesTokenizer; a sentencepiece model file or a piece table (sherpa-onnx's
``tokens.txt``, FunASR's ``tokens.json``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from streamer.errors import ModelError


class Tokenizer(Protocol):
    """Token ids to text, as funasr's SentencepiecesTokenizer decodes them."""

    @property
    def size(self) -> int: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def pieces(self) -> list[str]: ...

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``; raises ModelError where the tokenizer cannot encode."""
        ...


class SentencePieceTokenizer:
    """A sentencepiece model file (bpe.model, chn_jpn_yue_eng_ko_spectok.bpe.model)."""

    def __init__(self, path: Path) -> None:
        import sentencepiece as spm

        try:
            self._processor = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:
            raise ModelError(f"Tokenizer {path} cannot be read ({error})") from error
        self.path = path

    @property
    def size(self) -> int:
        return int(self._processor.get_piece_size())

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._processor.decode([int(t) for t in token_ids]))

    def pieces(self) -> list[str]:
        return [self._processor.id_to_piece(i) for i in range(self.size)]

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (unknown characters give the unknown piece, id 0)."""
        return [int(i) for i in self._processor.encode(text)]


class PieceTableTokenizer:
    """A list of pieces (sherpa-onnx tokens.txt, FunASR tokens.json), decoded like
    sentencepiece: pieces joined, ``▁`` read as a space, the leading space dropped."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self._pieces = list(pieces)
        self._index: dict[str, int] | None = None  # piece -> id, made at the first encode
        self._longest = 1

    @property
    def size(self) -> int:
        return len(self._pieces)

    def decode(self, token_ids: Sequence[int]) -> str:
        text = "".join(self._pieces[int(t)] for t in token_ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    def pieces(self) -> list[str]:
        return list(self._pieces)

    def encode(self, text: str) -> list[int]:
        """``text`` as pieces, longest match first, spaces read as ``▁`` and a ``▁``
        in front (as sentencepiece's dummy prefix); a character no piece covers is
        the unknown piece (id 0)."""
        index = self._index
        if index is None:
            index = self._index = {piece: i for i, piece in enumerate(self._pieces)}
            self._longest = max((len(p) for p in self._pieces), default=1)
        rest = "▁" + text.replace(" ", "▁")
        ids = []
        while rest:
            for size in range(min(self._longest, len(rest)), 0, -1):
                piece = index.get(rest[:size])
                if piece is not None:
                    ids.append(piece)
                    rest = rest[size:]
                    break
            else:
                ids.append(0)
                rest = rest[1:]
        return ids


def read_tokens_txt(path: Path) -> list[str]:
    """sherpa-onnx's ``tokens.txt``: one ``piece id`` per line, ids 0..V-1."""
    pieces: dict[int, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        piece, _, index = line.rstrip("\n").rpartition(" ")
        if not piece or not index.isdigit():
            raise ModelError(f"{path}:{number} is not 'piece id': {line!r}")
        pieces[int(index)] = piece
    if sorted(pieces) != list(range(len(pieces))):
        raise ModelError(f"{path} does not number its pieces 0..{len(pieces) - 1}")
    return [pieces[i] for i in range(len(pieces))]


def read_tokens_json(path: Path) -> list[str]:
    """FunASR's ``tokens.json``: a JSON list of pieces, in id order."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelError(f"{path} is not a JSON list of tokens ({error})") from error
    if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
        raise ModelError(f"{path} is not a JSON list of token strings")
    return data


def write_tokens_txt(path: Path, pieces: Sequence[str]) -> None:
    path.write_text("".join(f"{p} {i}\n" for i, p in enumerate(pieces)), encoding="utf-8")
