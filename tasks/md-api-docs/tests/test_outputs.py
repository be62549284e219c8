import doctest
import inspect
import pathlib
import re

import minimd

API = pathlib.Path("/app/docs/API.md")


def sections():
    text = API.read_text()
    parts = re.split(r"^## +", text, flags=re.M)[1:]
    out = {}
    for part in parts:
        title, _, body = part.partition("\n")
        name = title.strip().strip("`").split("(")[0].strip()
        out[name] = body
    return out


def test_every_public_function_has_a_section():
    secs = sections()
    for name in minimd.__all__:
        assert name in secs, f"no '## {name}' section"


def test_parameters_documented():
    secs = sections()
    for name in minimd.__all__:
        for param in inspect.signature(getattr(minimd, name)).parameters:
            assert f"`{param}`" in secs[name] or re.search(rf"`[^`]*\b{param}\b[^`]*`", secs[name]), \
                f"{name}: parameter {param} not documented"
        assert re.search(r"\breturn", secs[name], re.I), f"{name}: return value not described"


def test_examples_are_real_doctests():
    secs = sections()
    parser = doctest.DocTestParser()
    for name in minimd.__all__:
        blocks = re.findall(r"```python\n(.*?)```", secs[name], re.S)
        assert blocks, f"{name}: no python example"
        source = "\n".join(blocks)
        assert name + "(" in source, f"{name}: example does not call {name}"
        test = parser.get_doctest(source, {}, name, "API.md", 0)
        assert test.examples, f"{name}: example has no >>> lines"
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=lambda s: None)
        assert runner.failures == 0, f"{name}: example output is wrong"


def test_readme_links_api():
    assert re.search(r"\]\((\./)?docs/API\.md\)", pathlib.Path("/app/README.md").read_text())
