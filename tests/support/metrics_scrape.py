"""A /metrics scrape read with `prometheus_client`'s own parser (the exposition's oracle)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families


@dataclasses.dataclass
class Scrape:
    """types: family name -> type; samples: (sample name, sorted label items) -> value."""

    types: dict[str, str]
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    labels: dict[str, set[tuple[str, ...]]]  # sample name -> the label names of its series

    def __call__(self, name: str, **labels: str) -> float:
        """A sample's value; 0 when the series is absent (a labelled counter not yet incremented)."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def delta(self, before: Scrape, name: str, **labels: str) -> float:
        return self(name, **labels) - before(name, **labels)


def parse(text: str) -> Scrape:
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    labels: dict[str, set[tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in types, f"family {family.name} twice"
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"sample {key} twice"
            samples[key] = s.value
            labels.setdefault(s.name, set()).add(tuple(sorted(s.labels)))
    return Scrape(types, samples, labels)


def scrape(http, path: str = "/metrics") -> Scrape:
    """GET /metrics with `http`'s credentials: a 200 in the library's content type, parsed."""
    r = http.get(path)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST, r.headers
    return parse(r.text)
