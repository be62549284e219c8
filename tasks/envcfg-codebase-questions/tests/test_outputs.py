import json
import pathlib


def answers():
    return json.loads(pathlib.Path("/app/answers.json").read_text())


def test_q1_q2():
    a = answers()
    assert str(a["q1"]).strip().lower() == "file"
    assert str(a["q2"]).strip().lower() == "b"


def test_q3():
    assert sorted(answers()["q3"]) == ["1", "on", "true", "yes"]


def test_q4_q5():
    a = answers()
    assert int(a["q4"]) == 10
    assert a["q5"] == "main.timeout"


def test_code_untouched():
    import envcfg.interpolate as i
    import envcfg.settings as s
    assert i.MAX_DEPTH == 10 and s._TRUE == {"1", "true", "yes", "on"}
