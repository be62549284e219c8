import pytest

from webutil.articles import Article
from webutil.slugs import slugify


@pytest.mark.parametrize("title,want", [
    ("Crème Brûlée à Paris", "creme-brulee-a-paris"),
    ("Ærøskøbing", "aeroskobing"),
    ("Straße & Œuvre", "strasse-and-oeuvre"),
    ("Łódź / Đakovo", "lodz-dakovo"),
    ("Hello, World!", "hello-world"),
    ("   ", "n-a"),
    ("日本語", "n-a"),
    ("ﬁnal Ｆｕｌｌｗｉｄｔｈ", "final-fullwidth"),
])
def test_transliteration(title, want):
    assert slugify(title) == want


def test_truncation_on_word_boundary():
    assert slugify("the quick brown fox jumps", max_length=15) == "the-quick-brown"
    assert slugify("the quick brown fox jumps", max_length=14) == "the-quick"
    assert slugify("supercalifragilistic word", max_length=8) == "supercal"
    long = slugify("word " * 40)
    assert len(long) <= 80 and not long.endswith("-") and long.startswith("word-word")


def test_uniqueness():
    assert slugify("Hello", existing={"hello"}) == "hello-2"
    assert slugify("Hello", existing=["hello", "hello-2", "hello-3"]) == "hello-4"
    s = slugify("the quick brown fox", max_length=15, existing={"the-quick-brown"})
    assert s == "the-quick-2" and len(s) <= 15
    assert slugify("abcdefghij", max_length=10, existing={"abcdefghij"}) == "abcdefgh-2"


def test_article_url():
    assert Article("Crème Brûlée").url == "/articles/creme-brulee/"
