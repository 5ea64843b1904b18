"""Hotwords: phrases a session wants recognised, as validated data (I/O-free).

Each protocol names them its own way (v1 ``hotwords``, Deepgram ``keywords`` and
``keyterm``, FunASR's ``hotwords`` JSON, OpenAI's ``prompt``, the server's
``--hotwords`` file); this module turns each into one tuple of :class:`Hotword` and
checks what can be checked without the model. What needs the tokenizer (a phrase it
cannot encode, one over ``--hotwords-max-tokens`` tokens) is checked where the
tokenizer lives, by the model worker (:mod:`streamer.model.decode.hotword_graphs`).

A hotword's ``boost`` is the bonus added to a hypothesis's log-probability (natural
log) for each token of the phrase it has matched, in the CTC beam search
(:mod:`streamer.model.decode.ctc_beam`); a match that breaks off takes its bonus back.
Phrases are user data: never log them above debug.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from streamer.errors import InvalidHotwords

DEFAULT_BOOST = 2.0  # bonus per matched token, natural-log probability
MAX_BOOST = 10.0  # larger boosts are refused: 10 per token already overrides the audio
MAX_PHRASES = 1000  # per session, and per --hotwords file
MAX_PHRASE_CHARS = 256  # a phrase's length before tokenizing (tokens are limited later)
MAX_PHRASE_TOKENS = 32  # default of --hotwords-max-tokens (checked by the model worker)
FUNASR_WEIGHT_PER_BOOST = 10.0  # FunASR's weight 20 (its clients' example) is boost 2.0
_SPACES = re.compile(r"\s+")
MAX_TERM_WORDS = 4  # a prompt's term of more words is a sentence: its names are kept
_PROMPT_SEPARATORS = re.compile(r"[,;\n，；、]|[.!?](?=\s|$)|[。！？]")
_KEEP_INSIDE = frozenset("'’-&.+#")  # kept: "Anthropic's", "Node.js", "C++", "C#"
_COMMON_WORDS = frozenset(
    """a an and are as at be but by for from has have he her his i if in into is it its
    me my no not of on or our she so that the their them then there these they this to
    us was we were what when where which who will with you your please expect words
    transcribe transcript transcription speaker speakers talk talks about audio
    recording meeting""".split()
)


@dataclass(frozen=True)
class Hotword:
    """One phrase to favour, and how strongly."""

    phrase: str  # whitespace-normalised, 1..MAX_PHRASE_CHARS characters
    boost: float = DEFAULT_BOOST  # bonus per matched token (log-probability), 0..MAX_BOOST


Hotwords = tuple[Hotword, ...]


def hotword(
    phrase: Any, boost: Any = DEFAULT_BOOST, *, where: str = "hotword", clamp: bool = False
) -> Hotword:
    """A checked :class:`Hotword`; raises :class:`InvalidHotwords` saying ``where``.

    With ``clamp``, a boost over :data:`MAX_BOOST` is taken as MAX_BOOST (protocols
    whose weights have no upper bound: Deepgram's intensifiers, FunASR's weights)."""
    if not isinstance(phrase, str):
        raise InvalidHotwords(f"{where}: a phrase must be a string")
    text = _SPACES.sub(" ", phrase).strip()
    if not text:
        raise InvalidHotwords(f"{where}: the phrase is empty")
    if len(text) > MAX_PHRASE_CHARS:
        raise InvalidHotwords(f"{where}: a phrase has at most {MAX_PHRASE_CHARS} characters")
    return Hotword(text, _boost(boost, where, clamp))


def _boost(value: Any, where: str, clamp: bool) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise InvalidHotwords(f"{where}: the boost must be a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidHotwords(f"{where}: the boost must be a number")
    boost = float(value)
    if clamp and boost > MAX_BOOST:
        boost = MAX_BOOST
    if not math.isfinite(boost) or not 0.0 <= boost <= MAX_BOOST:
        raise InvalidHotwords(f"{where}: the boost must be within 0..{MAX_BOOST:g}")
    return boost


def _checked(words: Iterable[Hotword], source: str) -> Hotwords:
    """Duplicates merged (the last boost wins), at most MAX_PHRASES."""
    unique: dict[str, Hotword] = {}
    for word in words:
        unique.pop(word.phrase, None)
        unique[word.phrase] = word
        if len(unique) > MAX_PHRASES:
            raise InvalidHotwords(f"{source}: at most {MAX_PHRASES} phrases per session")
    return tuple(unique.values())


def phrase_with_boost(text: str, *, where: str = "hotword", clamp: bool = False) -> Hotword:
    """``phrase`` or ``phrase:boost`` (Deepgram's ``keywords``, the ``--hotwords`` file,
    v1's URL query). A phrase cannot itself hold a colon: what follows the last one
    must be a number."""
    phrase, colon, boost = text.rpartition(":")
    if not colon:
        return hotword(text, where=where)
    return hotword(phrase, boost, where=where, clamp=clamp)


def parse_v1(value: Any, *, strings: bool = False) -> Hotwords:
    """Protocol v1's ``hotwords``: in a ``config`` message a list of phrases or
    ``{"phrase": ..., "boost": ...}`` objects; in the URL query (``strings``) a
    comma-separated list of ``phrase`` or ``phrase:boost``."""
    if strings and isinstance(value, str):
        items: list[Any] = [item for item in value.split(",") if item.strip()]
        if not items:
            return ()
        return _checked(
            (phrase_with_boost(item, where=f"hotwords[{i}]") for i, item in enumerate(items)),
            "hotwords",
        )
    if not isinstance(value, list):
        raise InvalidHotwords("option 'hotwords' must be a list of phrases or {phrase, boost}")
    words = []
    for i, item in enumerate(value):
        where = f"hotwords[{i}]"
        if isinstance(item, Mapping):
            unknown = set(item) - {"phrase", "boost"}
            if unknown or "phrase" not in item:
                raise InvalidHotwords(f"{where}: an object has 'phrase' and optionally 'boost'")
            if isinstance(item.get("boost"), str):
                raise InvalidHotwords(f"{where}: the boost must be a number")
            words.append(hotword(item["phrase"], item.get("boost", DEFAULT_BOOST), where=where))
        else:
            words.append(hotword(item, where=where))
    return _checked(words, "hotwords")


def as_v1(words: Hotwords) -> list[dict[str, Any]]:
    """The ``config`` form of ``words`` (what ``ready`` reports)."""
    return [{"phrase": w.phrase, "boost": w.boost} for w in words]


def as_query(words: Hotwords) -> str:
    """The URL-query form of ``words`` (``phrase:boost,...``), which :func:`parse_v1`
    reads back; raises InvalidHotwords for a phrase with a comma or a colon (send those
    in a ``config`` message)."""
    for i, word in enumerate(words):
        if "," in word.phrase or ":" in word.phrase:
            raise InvalidHotwords(f"hotwords[{i}]: a URL's phrase cannot hold ',' or ':'")
    return ",".join(f"{w.phrase}:{w.boost:g}" for w in words)


def parse_deepgram(keywords: Sequence[str], keyterms: Sequence[str]) -> Hotwords:
    """Deepgram's repeatable ``keywords=phrase:boost`` (boost optional) and
    ``keyterm=phrase`` (the default boost). The intensifier is the boost, at most
    MAX_BOOST; Deepgram's negative ones (suppression) are refused: the search only adds
    bonuses."""
    words = [
        phrase_with_boost(k, where=f"keywords[{i}]", clamp=True) for i, k in enumerate(keywords)
    ]
    words += [hotword(k, where=f"keyterm[{i}]") for i, k in enumerate(keyterms)]
    return _checked(words, "keywords")


def parse_funasr(value: Any) -> Hotwords:
    """FunASR's ``hotwords``: a JSON string of phrase -> weight (``{"阿里巴巴": 20}``),
    maybe empty. The weight divided by :data:`FUNASR_WEIGHT_PER_BOOST` is the boost (at
    most MAX_BOOST)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return ()
    try:
        table = orjson.loads(value) if isinstance(value, str) else value
    except orjson.JSONDecodeError:
        table = None
    if not isinstance(table, dict):
        raise InvalidHotwords('hotwords must be a JSON object of phrase: weight ({"phrase": 20})')
    words = []
    for i, (phrase, weight) in enumerate(table.items()):
        where = f"hotwords[{i}]"
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise InvalidHotwords(f"{where}: the weight must be a number")
        words.append(hotword(phrase, weight / FUNASR_WEIGHT_PER_BOOST, where=where, clamp=True))
    return _checked(words, "hotwords")


def parse_prompt(prompt: str) -> Hotwords:
    """OpenAI's transcription ``prompt``, which is free text, as hotwords; never raises
    (a prompt is text, not a contract).

    Split at commas, semicolons, line breaks and sentence ends; each short term (at most
    :data:`MAX_TERM_WORDS` words: a list of names) is a phrase. A longer term is a
    sentence ("expect words about Kubernetes and Claude Code"): only its names are kept,
    runs of words with a capital letter, a digit or a non-ASCII letter that are not
    common words ("Kubernetes", "Claude Code"), since boosting "expect" or "about" helps
    nothing. Symbols the tokenizer cannot spell (emoji) are dropped from each term; what
    the model still cannot use is skipped by the worker, which says so in a notice."""
    phrases: list[str] = []
    for term in _PROMPT_SEPARATORS.split(prompt):
        words = _clean_term(term).split()
        if len(words) <= MAX_TERM_WORDS:
            phrases.append(" ".join(words))
        else:
            phrases.extend(_names(words))
    return parse_terms(phrases)


def parse_terms(terms: Iterable[Any]) -> Hotwords:
    """Phrases to favour with the default boost (OpenAI's ``keywords``, the prompt's
    terms), leniently: a term that is not a string, empty once symbols are dropped, or
    over :data:`MAX_PHRASE_CHARS` characters is skipped, and past :data:`MAX_PHRASES`
    the rest is ignored; never raises."""
    words = []
    for term in terms:
        if not isinstance(term, str):
            continue
        text = _clean_term(term)
        if text and len(text) <= MAX_PHRASE_CHARS:
            words.append(Hotword(text))
    unique = {word.phrase: word for word in words}
    return tuple(unique.values())[:MAX_PHRASES]


def _clean_term(term: str) -> str:
    """``term`` with symbols, emoji and punctuation other than :data:`_KEEP_INSIDE`
    replaced by spaces, spaces collapsed, and no punctuation at either end."""
    kept = []
    for char in term:
        category = unicodedata.category(char)
        if category[0] in "LMN" or char in _KEEP_INSIDE:
            kept.append(char)
        else:
            kept.append(" ")
    words = ("".join(kept)).split()
    return " ".join(word.strip("'’-&.") for word in words).strip()


def _names(words: Sequence[str]) -> list[str]:
    """The runs of name-like words in a sentence's ``words`` (at most MAX_TERM_WORDS)."""
    names: list[str] = []
    run: list[str] = []
    for word in words:
        if _name_like(word):
            run.append(word)
            if len(run) < MAX_TERM_WORDS:
                continue
        if run:
            names.append(" ".join(run))
            run = []
    if run:
        names.append(" ".join(run))
    return names


def _name_like(word: str) -> bool:
    if word.lower() in _COMMON_WORDS:
        return False
    return any(c.isupper() or c.isdigit() or (c.isalpha() and not c.isascii()) for c in word)


def parse_file(text: str, *, name: str = "hotwords file") -> Hotwords:
    """A ``--hotwords`` file: one ``phrase`` or ``phrase:boost`` a line; blank lines and
    lines starting with ``#`` are skipped. Raises InvalidHotwords naming the line."""
    words = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        words.append(phrase_with_boost(line, where=f"{name}:{number}"))
    return _checked(words, name)


def merge(server: Hotwords, session: Hotwords) -> Hotwords:
    """The server's phrases and the session's: a phrase in both takes the session's
    boost. The session's are limited on their own; the server's file likewise."""
    if not server:
        return session
    own = {w.phrase for w in session}
    return tuple(w for w in server if w.phrase not in own) + session


def active(words: Hotwords) -> Hotwords:
    """The phrases that change decoding: a boost of 0 is no bias at all (greedy)."""
    return tuple(w for w in words if w.boost > 0)
