"""Articles and their URLs."""
from dataclasses import dataclass, field

from .slugs import slugify


@dataclass
class Article:
    title: str
    body: str = ""
    slug: str = field(init=False)

    def __post_init__(self):
        self.slug = slugify(self.title)

    @property
    def url(self):
        return f"/articles/{self.slug}/"
