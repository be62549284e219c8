import os
import re
import shlex
import subprocess
import sys
import pathlib

from csvreport.cli import build_parser

README = pathlib.Path("/app/README.md")


def usage_section():
    text = README.read_text()
    m = re.search(r"^##+ *Usage\b(.*?)(?=^## [^#]|\Z)", text, re.S | re.M)
    assert m, "no Usage section"
    return m.group(1)


def test_every_option_documented_with_default():
    sec = usage_section()
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        names = action.option_strings or [action.dest]
        assert any(f"`{n}`" in sec for n in names), f"{names} not documented"
        line = next(l for l in sec.splitlines() if any(f"`{n}`" in l for n in names))
        if action.option_strings and action.default not in (None, False) and not action.required:
            assert str(action.default) in line, f"default of {names[0]} missing"
        if action.choices:
            for choice in action.choices:
                assert f"`{choice}`" in line or re.search(rf"\b{choice}\b", line), f"choice {choice} missing"


def test_worked_example_is_true(tmp_path):
    sec = usage_section()
    csv_block = re.search(r"```csv\n(.*?)```", sec, re.S)
    sh_block = re.search(r"```(?:sh|bash|shell)\n(.*?)```", sec, re.S)
    out_block = re.search(r"```text\n(.*?)```", sec, re.S)
    assert csv_block and sh_block and out_block
    cmd = shlex.split(sh_block.group(1).strip().splitlines()[0].lstrip("$ "))
    assert cmd[:3] == ["python3", "-m", "csvreport"]
    file_arg = next(a for a in cmd[3:] if not a.startswith("-") and a.endswith(".csv"))
    (tmp_path / file_arg).write_text(csv_block.group(1))
    proc = subprocess.run([sys.executable] + cmd[1:], cwd=tmp_path, capture_output=True, text=True, timeout=20,
                          env=dict(os.environ, PYTHONPATH="/app"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == out_block.group(1).strip()
    assert proc.stdout.strip()
