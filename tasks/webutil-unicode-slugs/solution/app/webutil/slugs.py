"""URL slugs for article titles."""
import re
import unicodedata

_SPECIAL = {"æ": "ae", "ø": "o", "ß": "ss", "œ": "oe", "ł": "l", "đ": "d", "&": " and "}


def _ascii(text):
    text = "".join(_SPECIAL.get(c, c) for c in text.lower())
    decomposed = unicodedata.normalize("NFKD", text)
    return decomposed.encode("ascii", "ignore").decode("ascii")


def _truncate(slug, max_length):
    if len(slug) <= max_length:
        return slug
    cut = slug[:max_length + 1]
    if "-" in cut:
        head = cut[:cut.rindex("-")].rstrip("-")
        if head:
            return head
    return slug[:max_length].rstrip("-")


def slugify(title, max_length=80, existing=()):
    if max_length < 1:
        raise ValueError("max_length must be positive")
    slug = re.sub(r"[^a-z0-9]+", "-", _ascii(title)).strip("-") or "n-a"
    slug = _truncate(slug, max_length)
    taken = set(existing)
    if slug not in taken:
        return slug
    n = 2
    while True:
        suffix = f"-{n}"
        candidate = _truncate(slug, max_length - len(suffix)) + suffix if len(slug) + len(suffix) > max_length \
            else slug + suffix
        if candidate not in taken:
            return candidate
        n += 1
