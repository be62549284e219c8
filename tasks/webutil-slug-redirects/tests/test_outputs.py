from webutil.articles import Article, resolve


def test_slug_follows_title():
    a = Article("First Draft", body="x")
    assert a.slug == "first-draft" and a.previous_slugs == [] and a.body == "x"
    a.title = "Second Take"
    assert a.title == "Second Take" and a.slug == "second-take" and a.url == "/articles/second-take/"
    assert a.previous_slugs == ["first-draft"]


def test_history_rules():
    a = Article("A one")
    a.title = "B two"
    a.title = "B  Two!"          # same slug: no history entry
    a.title = "C three"
    assert a.previous_slugs == ["a-one", "b-two"]
    a.title = "A one"            # back to an old slug: it is current again, not in history
    assert a.slug == "a-one" and a.previous_slugs == ["b-two", "c-three"]
    a.title = "B two"
    assert a.previous_slugs == ["c-three", "a-one"]


def test_resolve():
    a, b = Article("Alpha"), Article("Beta")
    a.title = "Alpha Prime"
    arts = [a, b]
    assert resolve(arts, "/articles/alpha-prime/") == (a, None)
    assert resolve(arts, "/articles/alpha/") == (a, "/articles/alpha-prime/")
    assert resolve(arts, "/articles/beta/") == (b, None)
    assert resolve(arts, "/articles/gamma/") == (None, None)
    b.title = "Alpha"            # a new article takes the old slug: current URL wins over redirect
    assert resolve(arts, "/articles/alpha/") == (b, None)
