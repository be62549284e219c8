"""Articles and their URLs; renamed articles keep their old slugs for redirects."""
from .slugs import slugify


class Article:
    def __init__(self, title, body=""):
        self.body = body
        self.previous_slugs = []
        self._title = title
        self.slug = slugify(title)

    @property
    def title(self):
        return self._title

    @title.setter
    def title(self, value):
        new_slug = slugify(value)
        if new_slug != self.slug:
            if self.slug not in self.previous_slugs:
                self.previous_slugs.append(self.slug)
            if new_slug in self.previous_slugs:
                self.previous_slugs.remove(new_slug)
            self.slug = new_slug
        self._title = value

    @property
    def url(self):
        return f"/articles/{self.slug}/"

    def __repr__(self):
        return f"Article({self._title!r})"


def resolve(articles, path):
    """(article, None) for a current URL, (article, current_url) for an old one, else (None, None)."""
    for a in articles:
        if a.url == path:
            return a, None
    for a in articles:
        if any(f"/articles/{s}/" == path for s in a.previous_slugs):
            return a, a.url
    return None, None
