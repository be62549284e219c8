from envcfg.loader import parse_text


def test_sections():
    assert parse_text("a = 1\n[db]\nhost = x\n") == {"main.a": "1", "db.host": "x"}
