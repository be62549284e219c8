from minimd import parse_blocks, to_html


def test_simple_ordered():
    assert to_html("1. foo\n2. bar") == "<ol><li>foo</li><li>bar</li></ol>"


def test_paren_style_and_inline():
    assert to_html("1) **a**\n2) `b`") == "<ol><li><strong>a</strong></li><li><code>b</code></li></ol>"


def test_start_attribute():
    assert to_html("3. c\n4. d") == '<ol start="3"><li>c</li><li>d</li></ol>'
    assert to_html("10. x") == '<ol start="10"><li>x</li></ol>'


def test_parse_blocks_shape():
    assert parse_blocks("intro\n\n5. a\n6. b\n\ntail") == [
        ("para", "intro"), ("ol", 5, ["a", "b"]), ("para", "tail")]


def test_switching_list_kinds():
    assert to_html("- a\n1. b\n2. c\n- d") == (
        "<ul><li>a</li></ul>\n<ol><li>b</li><li>c</li></ol>\n<ul><li>d</li></ul>")


def test_paragraph_then_list_and_not_a_list():
    assert to_html("text\n\n2. b") == '<p>text</p>\n<ol start="2"><li>b</li></ol>'
    assert to_html("Version 2.0 is out") == "<p>Version 2.0 is out</p>"
    assert to_html("1.5 litres") == "<p>1.5 litres</p>"


def test_existing_behaviour():
    assert to_html("# H\n- x\n- y\n\ntext *e*") == "<h1>H</h1>\n<ul><li>x</li><li>y</li></ul>\n<p>text <em>e</em></p>"
