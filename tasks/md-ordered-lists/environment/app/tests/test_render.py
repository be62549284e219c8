from minimd import to_html


def test_heading_and_para():
    assert to_html("# Hi\n\nsome *text*") == "<h1>Hi</h1>\n<p>some <em>text</em></p>"
