"""PII detectors and strategies, and the look-back buffer that redacts text while it streams.

A `PIIDetector` finds spans of one kind of PII in a text: a regex (plus an optional validator,
e.g. the Luhn check for card numbers) or a callable ``fn(text) -> [(start, end), ...]``. Its
``charset`` (a regex character class) covers every character a match can contain: the streaming
buffer uses it to know what it may release. A position can start a match that is still growing
only if every character from it to the end of the text so far is in the charset, so the buffer
holds back just the trailing run of such characters (the last word, for most kinds) and releases
the rest the moment a character outside the charset arrives.

`Redactor` applies the detectors and strategies to a whole text (`redact`) and `StreamRedactor`
does the same to text arriving in pieces: the concatenation of what it releases equals
``redact(whole text)`` for every way of splitting the text (the tests try every split point).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

__all__ = ["BUILTIN_DETECTORS", "PIIDetector", "PIIMatch", "Redactor", "Strategy", "StreamRedactor", "luhn_valid"]

Strategy: TypeAlias = Literal["redact", "mask", "hash", "block"]
STRATEGIES: tuple[str, ...] = ("redact", "mask", "hash", "block")
Finder: TypeAlias = Callable[[str], Iterable[tuple[int, int]]]

_CONTEXT = 16  # released characters kept as look-behind context for the detectors (\b, (?<!…))


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum of a card number (digits only)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(text: str) -> bool:
    digits = re.sub(r"\D", "", text)
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


_DATE = re.compile(r"\d{4}[./-]\d{1,2}[./-]\d{1,2}|\d{1,2}[./-]\d{1,2}[./-]\d{2,4}")


def _phone(text: str) -> bool:
    digits = sum(ch.isdigit() for ch in text)
    if _DATE.fullmatch(text):
        return False  # 2024-01-15 is a date
    if text.isdigit():
        return 10 <= digits <= 15  # a bare number must be long to be a phone number (not an order id)
    return 7 <= digits <= 15


def _ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return ":" in text or text.count(".") == 3


@dataclass(frozen=True)
class PIIDetector:
    """One kind of PII. Give ``pattern`` (a regex, compiled at construction: an invalid one is a
    ValueError) or ``find`` (``fn(text) -> [(start, end), ...]``). ``validate`` filters regex
    matches. ``charset``: a regex character class covering every character a match can contain
    (default ``\\S``: matches never span whitespace); the streaming buffer relies on it."""

    name: str
    pattern: str | re.Pattern[str] | None = None
    find: Finder | None = None
    validate: Callable[[str], bool] | None = None
    charset: str = r"\S"
    _regex: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)
    _chars: re.Pattern[str] = field(default=re.compile(r"\S"), init=False, repr=False, compare=False)
    _run: re.Pattern[str] = field(default=re.compile(r"\S*"), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][\w-]*", self.name):
            raise ValueError(f"PIIDetector name must be an identifier such as 'api_key', not {self.name!r}")
        if (self.pattern is None) == (self.find is None):
            raise ValueError(f"PIIDetector {self.name!r}: give exactly one of pattern= (a regex) or find= (a callable)")
        if self.find is not None and not callable(self.find):
            raise TypeError(f"PIIDetector {self.name!r}: find must be a callable fn(text) -> [(start, end), ...]")
        if self.pattern is not None:
            try:
                regex = self.pattern if isinstance(self.pattern, re.Pattern) else re.compile(self.pattern)
            except (re.error, TypeError) as exc:
                raise ValueError(f"PIIDetector {self.name!r}: invalid regex {self.pattern!r}: {exc}") from None
            object.__setattr__(self, "_regex", regex)
        try:
            chars = re.compile(f"(?:{self.charset})+\\Z")
        except re.error as exc:
            raise ValueError(f"PIIDetector {self.name!r}: invalid charset {self.charset!r}: {exc}") from None
        object.__setattr__(self, "_chars", chars)
        object.__setattr__(self, "_run", re.compile(f"(?:{self.charset})*"))

    def spans(self, text: str, pos: int = 0) -> list[tuple[int, int]]:
        """The matches in ``text`` that start at or after ``pos`` (what is before is context)."""
        if self._regex is not None:
            found = ((m.start(), m.end()) for m in self._regex.finditer(text, pos) if m.end() > m.start())
            if self.validate is not None:
                return [(s, e) for s, e in found if self.validate(text[s:e])]
            return list(found)
        assert self.find is not None
        out = []
        for span in self.find(text[pos:]):
            start, end = int(span[0]) + pos, int(span[1]) + pos
            if not pos <= start < end <= len(text):
                raise ValueError(f"PIIDetector {self.name!r}: find returned the span {span!r} outside the text")
            out.append((start, end))
        return out

    def open_tail(self, text: str) -> int:
        """Where the trailing run of charset characters starts (``len(text)``: there is none)."""
        # Searching from the end back would be quadratic on a long run; the charset regex anchored
        # at the end does it in one pass of the run.
        m = self._chars.search(text)
        return len(text) if m is None else m.start()

    def run_length(self, text: str) -> int:
        """How many of ``text``'s first characters are charset characters (a match could go on
        through them)."""
        m = self._run.match(text)
        return 0 if m is None else m.end()


BUILTIN_DETECTORS: Mapping[str, PIIDetector] = {
    d.name: d
    for d in (
        PIIDetector("email", r"(?<![\w.%+-])[\w.%+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}(?![\w-])",
                    charset=r"[\w.%+@-]"),
        PIIDetector("credit_card", r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d])", validate=_card, charset=r"[\d -]"),
        PIIDetector("url", r"(?<![\w@])(?:[A-Za-z][A-Za-z0-9+.-]*://|www\.)[^\s<>\"'`]*[^\s<>\"'`.,;:!?)\]}]",
                    charset=r"[^\s<>\"'`]"),
        PIIDetector("ip", r"(?<![\w.:])(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7})"
                    r"(?![\w.:])", validate=_ip, charset=r"[0-9A-Fa-f.:]"),
        PIIDetector("phone", r"(?<![\w+])\+?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\(?\d{1,4}\)?){1,5}(?![\w])",
                    validate=_phone, charset=r"[\d ().+-]"),
    )
}
"""email, credit_card (Luhn-checked), url (scheme:// or www.), ip (IPv4 and IPv6, checked by
`ipaddress`), phone (7–15 digits with the usual separators; a bare number needs 10; dates are not
phone numbers). Earlier in this order wins when two
overlap at the same place: a card number is not also a phone number."""


@dataclass(frozen=True)
class PIIMatch:
    kind: str
    start: int
    end: int
    text: str


def _mask(kind: str, text: str) -> str:
    if kind == "email":
        local, _, domain = text.partition("@")
        return local[:1] + "*" * max(len(local) - 1, 1) + "@" + domain
    keep = 4
    out, seen = [], 0
    for ch in reversed(text):
        if ch.isalnum():
            seen += 1
            out.append(ch if seen <= keep else "*")
        else:
            out.append(ch)
    return "".join(reversed(out))


class Redactor:
    """Applies detectors and per-kind strategies to text. ``replacement``: a template for the
    redact strategy (``{kind}`` is the detector's name upper-cased, ``{name}`` the name as it is)."""

    def __init__(
        self,
        detectors: Sequence[PIIDetector],
        strategies: Mapping[str, Strategy],
        *,
        replacement: str = "[REDACTED_{kind}]",
        on_block: Callable[[PIIMatch], BaseException] | None = None,
    ) -> None:
        self.detectors = tuple(detectors)
        self.strategies = dict(strategies)
        self.replacement = replacement
        self.on_block = on_block

    def matches(self, text: str, pos: int = 0) -> list[PIIMatch]:
        """Non-overlapping matches from ``pos`` on, in text order; at one place the longest wins,
        then the detector listed first."""
        found: list[tuple[int, int, int, PIIDetector]] = []
        for rank, det in enumerate(self.detectors):
            found.extend((s, -(e - s), rank, det) for s, e in det.spans(text, pos))
        found.sort(key=lambda f: (f[0], f[1], f[2]))
        out: list[PIIMatch] = []
        end = pos
        for start, neg_len, _, det in found:
            if start >= end:
                out.append(PIIMatch(det.name, start, start - neg_len, text[start:start - neg_len]))
                end = start - neg_len
        return out

    def replace(self, match: PIIMatch) -> str:
        strategy = self.strategies[match.kind]
        if strategy == "block":
            if self.on_block is not None:
                raise self.on_block(match)
            raise ValueError(f"{match.kind} detected")
        if strategy == "mask":
            return _mask(match.kind, match.text)
        if strategy == "hash":
            digest = hashlib.sha256(match.text.encode()).hexdigest()[:8]
            return f"<{match.kind}_hash:{digest}>"
        return self.replacement.format(kind=match.kind.upper(), name=match.kind)

    def redact(self, text: str) -> str:
        """``text`` with every match replaced (a ``block`` match raises)."""
        return self._apply(text, 0, len(text), self.matches(text))

    def _apply(self, text: str, start: int, stop: int, matches: Iterable[PIIMatch]) -> str:
        parts, at = [], start
        for m in matches:
            if m.start >= stop:
                break
            parts.append(text[at:m.start])
            parts.append(self.replace(m))
            at = m.end
        parts.append(text[at:stop])
        return "".join(parts)


class StreamRedactor:
    """The look-back buffer of one text block: ``feed(delta)`` returns the redacted text that can
    go out now (possibly ``""``), ``flush()`` the rest at the block's end. Nothing of a match is
    released before the match is complete; text is released as soon as no match can reach it.

    ``max_hold`` bounds the held text, and nothing unscanned ever goes out: past the bound, the
    held run that could still be part of a match (a base64 blob, or a long run ending in an
    address) is replaced by one ``unscanned`` placeholder (the replacement template with kind
    ``UNSCANNED``), and so is the rest of that run as it streams on, until a character that no
    open detector's charset has ends it."""

    __slots__ = ("_context", "_held", "_open", "max_hold", "redactor")

    def __init__(self, redactor: Redactor, max_hold: int = 4096) -> None:
        self.redactor = redactor
        self.max_hold = max_hold
        self._held = ""
        self._context = ""  # the last released characters, unredacted (look-behind context only)
        self._open: tuple[PIIDetector, ...] = ()  # detectors whose overlong run is being dropped

    @property
    def held(self) -> str:
        return self._held

    def feed(self, delta: str) -> str:
        if self._open:
            delta = self._drop_run(delta)
            if not delta:
                return ""
        text = self._context + self._held + delta
        pos = len(self._context)
        cut = min(d.open_tail(text) for d in self.redactor.detectors)
        cut = max(cut, pos)
        matches = self.redactor.matches(text, pos)
        for m in matches:  # a match reaching into the held tail may still grow: hold all of it
            if m.end > cut:
                cut = min(cut, m.start)
                break
        if len(text) - cut > self.max_hold:
            return self._overflow(text, pos, cut, matches)
        return self._release(text, pos, cut, matches)

    def flush(self) -> str:
        self._open = ()
        text = self._context + self._held
        return self._release(text, len(self._context), len(text))

    def _release(self, text: str, pos: int, cut: int, matches: list[PIIMatch] | None = None) -> str:
        matches = self.redactor.matches(text, pos) if matches is None else [m for m in matches if m.end <= cut]
        out = self.redactor._apply(text, pos, cut, matches) if cut > pos else ""
        self._held = text[cut:]
        self._context = text[max(0, cut - _CONTEXT):cut]
        return out

    def _overflow(self, text: str, pos: int, cut: int, matches: list[PIIMatch]) -> str:
        """What is before the held run goes out scanned; the run itself, unscanned, does not."""
        out = self._release(text, pos, cut, matches)
        tail = self._held
        self._open = tuple(d for d in self.redactor.detectors if d.run_length(tail) == len(tail))
        self._held, self._context = "", ""
        return out + self.redactor.replacement.format(kind="UNSCANNED", name="unscanned")

    def _drop_run(self, delta: str) -> str:
        """``delta`` without the characters that continue the dropped run (any open detector's
        match could go on through them); a detector whose run ends is open no more."""
        lengths = [(d, d.run_length(delta)) for d in self._open]
        self._open = tuple(d for d, n in lengths if n == len(delta))
        return "" if self._open else delta[max(n for _, n in lengths):]
