"""File tools, path confinement, BM25 ranking and verifier-output parsing, without a sandbox."""

from __future__ import annotations

import math
import os

import pytest

from composer_jax.env.api.protocol import ToolArgumentError, ToolError, validate_call
from composer_jax.env.sandbox.workspace import PathEscapeError, Workspace
from composer_jax.env.tasks import grader
from composer_jax.env.tools import agent_tools as tools
from composer_jax.env.tools import semantic_search


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "app"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def parse_header(raw):\n    return raw.split(':')\n\nx = 1\nx = 1\n")
    (root / "README.md").write_text("line1\nline2\nline3\n")
    (tmp_path / "outside.txt").write_text("host secret")
    return Workspace(root)


def test_read_file_ranges(ws):
    r = tools.read_file(ws, "README.md", start_line=2, end_line=3)
    assert r["content"] == "line2\nline3\n" and r["total_lines"] == 3 and r["end_line"] == 3
    assert tools.read_file(ws, "/app/README.md")["content"] == "line1\nline2\nline3\n"
    with pytest.raises(ToolError, match="has 3 lines; start_line 9"):
        tools.read_file(ws, "README.md", start_line=9)
    with pytest.raises(ToolError, match="no such file"):
        tools.read_file(ws, "nope.txt")


def test_edit_file_search_replace_and_create(ws):
    with pytest.raises(ToolError, match=r"occurs 2 times .*at lines \[4, 5\]"):
        tools.edit_file(ws, "pkg/mod.py", old_string="x = 1", new_string="x = 2")
    with pytest.raises(ToolError, match="old_string not found"):
        tools.edit_file(ws, "pkg/mod.py", old_string="y = 1", new_string="x = 2")
    assert (
        tools.edit_file(ws, "pkg/mod.py", old_string="x = 1", new_string="x = 2", replace_all=True)["replacements"] == 2
    )
    assert (ws.root / "pkg" / "mod.py").read_text().endswith("x = 2\nx = 2\n")
    r = tools.edit_file(ws, "new/dir/file.txt", new_string="hi")
    assert r["created"] and (ws.root / "new" / "dir" / "file.txt").read_text() == "hi"
    assert not tools.edit_file(ws, "new/dir/file.txt", new_string="again")["created"]


def test_paths_confined(ws, tmp_path):
    for bad in ("../outside.txt", "/etc/passwd", "pkg/../../outside.txt", "/app/../outside.txt"):
        with pytest.raises(PathEscapeError):
            tools.read_file(ws, bad)
    os.symlink(str(tmp_path / "outside.txt"), ws.root / "abs_link")
    os.symlink("../outside.txt", ws.root / "rel_link")
    os.symlink("/app/pkg", ws.root / "inside_link")
    for bad in ("abs_link", "rel_link"):
        with pytest.raises(PathEscapeError):
            tools.read_file(ws, bad)
        with pytest.raises(ToolError):
            tools.edit_file(ws, bad, new_string="pwned")
    assert (tmp_path / "outside.txt").read_text() == "host secret"
    assert "parse_header" in tools.read_file(ws, "inside_link/mod.py")["content"]


def test_list_dir_and_grep(ws):
    entries = tools.list_dir(ws, depth=2)["entries"]
    assert [(e["path"], e["type"]) for e in entries] == [
        ("/app/README.md", "file"),
        ("/app/pkg", "dir"),
        ("/app/pkg/mod.py", "file"),
    ]
    hits = tools.grep(ws, r"x = \d", glob="*.py")["matches"]
    assert [(h["path"], h["line"]) for h in hits] == [("/app/pkg/mod.py", 4), ("/app/pkg/mod.py", 5)]
    assert tools.grep(ws, "LINE", case_insensitive=True, glob="*.md", max_matches=2)["truncated"]
    with pytest.raises(ToolError, match="invalid regular expression"):
        tools.grep(ws, "(")
    (ws.root / "evil.txt").write_text("a" * 40 + "!\n")
    with pytest.raises(ToolError, match="catastrophic backtracking"):
        tools.grep(ws, "(a|aa)+$", glob="evil.txt")


def test_validate_call():
    assert validate_call("grep", {"pattern": "x"}) == {"pattern": "x"}
    with pytest.raises(ToolArgumentError, match="unknown tool 'rm'"):
        validate_call("rm", {})
    with pytest.raises(ToolArgumentError, match=r"unknown argument\(s\) \['colour'\]"):
        validate_call("list_dir", {"colour": 1})
    with pytest.raises(ToolArgumentError, match="'depth' = 9 must be in"):
        validate_call("list_dir", {"depth": 9})
    with pytest.raises(ToolArgumentError, match="must be of type integer"):
        validate_call("list_dir", {"depth": True})


def test_tokenize_splits_identifiers():
    assert semantic_search.tokenize("parseHTTPHeader") == ["parsehttpheader", "parse", "http", "header"]
    assert semantic_search.tokenize("parse_http_header") == ["parse_http_header", "parse", "http", "header"]


def test_bm25_matches_hand_computation():
    chunks = [semantic_search.Chunk("a", 1, 1, "apple apple banana"), semantic_search.Chunk("b", 1, 1, "cherry")]
    ((score, top),) = semantic_search.bm25_rank("apple", chunks, 5)
    # N=2, n=1: idf = ln(1 + 1.5/1.5) = ln 2. tokens(a) = apple,apple,banana,"a" -> |d| = 4;
    # tokens(b) = cherry,"b" -> 2; avgdl = 3. tf = 2: ln2 * 2 * 2.2 / (2 + 1.2 * (0.25 + 0.75 * 4/3))
    expected = math.log(2) * 2 * 2.2 / (2 + 1.2 * (0.25 + 0.75 * 4 / 3))
    assert top.path == "a" and score == pytest.approx(expected)
    assert semantic_search.search("apple", [("a", "apple")], 3)["ranking"] == "bm25"


def test_reward_files_and_junit(tmp_path):
    (tmp_path / "reward.txt").write_text("0.5\n")
    assert grader.read_reward(tmp_path) == (0.5, {}, None)
    (tmp_path / "reward.txt").write_text("great")
    assert "not a number" in grader.read_reward(tmp_path)[2]
    (tmp_path / "reward.txt").unlink()
    assert "neither" in grader.read_reward(tmp_path)[2]
    (tmp_path / "reward.json").write_text('{"reward": 1, "passed": 3}')
    assert grader.read_reward(tmp_path) == (1.0, {"passed": 3}, None)
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/><testcase classname="t" name="bad">'
        '<failure message="boom"/></testcase><testcase classname="t" name="skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert [(t["name"], t["outcome"]) for t in grader.parse_junit(tmp_path / "junit.xml")] == [
        ("t::ok", "passed"),
        ("t::bad", "failed"),
        ("t::skip", "skipped"),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.25", (0.25, {}, None)),  # a bare number
        ('{"accuracy": 0.5}', (0.5, {}, None)),  # the only value is the reward
        ('{"reward": 0.75, "tests": 4}', (0.75, {"tests": 4}, None)),
        ('{"reward": 1, "checked": "hello.txt"}', "checked='hello.txt'"),  # Harbor: numbers only
        ('{"reward": NaN}', "reward=nan"),
        ("{}", "an empty object"),
        ('{"a": 1, "b": 0}', 'several values (a, b) and no "reward"'),
        ("[1, 2]", "reward=[1, 2]"),
        ("", "not JSON"),
    ],
)
def test_reward_json_follows_harbor(tmp_path, text, expected):
    """Harbor reads reward.json before reward.txt, and refuses a value that is not a finite number."""
    (tmp_path / "reward.txt").write_text("0.0\n")  # ignored while reward.json exists
    (tmp_path / "reward.json").write_text(text)
    got = grader.read_reward(tmp_path)
    if isinstance(expected, tuple):
        assert got == expected
    else:
        assert got[0] is None and expected in got[2]


def test_workspace_diff(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x.py").write_text("1\n2\n")
    (b / "x.py").write_text("1\n3\n")
    (b / "new.txt").write_text("n\n")
    assert grader.workspace_diff(a, b) == (
        "diff --git a/new.txt b/new.txt\nnew file mode 100644\n--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+n\n"
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n 1\n-2\n+3\n"
    )  # a git-style patch (tests/env/sandbox/test_snapshot_patch.py applies them with git)
