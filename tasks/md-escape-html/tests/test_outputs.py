from html.parser import HTMLParser

from minimd import render_inline, to_html


class Events(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.events = []

    def handle_starttag(self, tag, attrs):
        self.events.append(("start", tag, tuple(attrs)))

    def handle_endtag(self, tag):
        self.events.append(("end", tag))

    def handle_data(self, data):
        if self.events and self.events[-1][0] == "text":
            self.events[-1] = ("text", self.events[-1][1] + data)
        else:
            self.events.append(("text", data))


def events(markup):
    p = Events()
    p.feed(markup)
    p.close()
    return p.events


def test_script_is_text():
    ev = events(to_html("hello <script>alert(1)</script> world"))
    assert ev == [("start", "p", ()), ("text", "hello <script>alert(1)</script> world"), ("end", "p")]


def test_ampersand_and_entities_literal():
    ev = events(render_inline("fish & chips &amp; 1 < 2 > 0"))
    assert ev == [("text", "fish & chips &amp; 1 < 2 > 0")]


def test_code_span_escaped_and_literal():
    ev = events(render_inline("use `<b>**x**</b> & y` now"))
    assert ev == [("text", "use "), ("start", "code", ()), ("text", "<b>**x**</b> & y"), ("end", "code"),
                  ("text", " now")]


def test_link_url_cannot_break_attribute():
    ev = events(render_inline('[x](http://e.com/a"onmouseover="alert&b=1)'))
    assert ev == [("start", "a", (("href", 'http://e.com/a"onmouseover="alert&b=1'),)), ("text", "x"),
                  ("end", "a")]


def test_link_with_query_not_double_escaped():
    out = render_inline("[q](http://e.com/?a=1&b=2)")
    assert "&amp;amp;" not in out
    assert events(out)[0] == ("start", "a", (("href", "http://e.com/?a=1&b=2"),))


def test_markup_still_works():
    ev = events(to_html("# T <i>\n\n**b** and *e* [l](u)\n- <li>"))
    assert ev == [
        ("start", "h1", ()), ("text", "T <i>"), ("end", "h1"), ("text", "\n"),
        ("start", "p", ()), ("start", "strong", ()), ("text", "b"), ("end", "strong"), ("text", " and "),
        ("start", "em", ()), ("text", "e"), ("end", "em"), ("text", " "),
        ("start", "a", (("href", "u"),)), ("text", "l"), ("end", "a"), ("end", "p"), ("text", "\n"),
        ("start", "ul", ()), ("start", "li", ()), ("text", "<li>"), ("end", "li"), ("end", "ul"),
    ]
