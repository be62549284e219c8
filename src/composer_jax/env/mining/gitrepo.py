"""Reading a local git repository for the task miner and the SWE-bench importer (git's CLI).

Only trusted operations run here, in the server's process: listing commits, diffing, writing a
commit's tree into a directory (a temporary index, so `export-ignore` attributes drop nothing
and the repository's own index and work tree are untouched) and `git apply` onto such a tree.
Nothing checked out here is executed outside the sandbox.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from datetime import UTC
from pathlib import Path

_TEST_DIR = re.compile(r"(^|/)(tests?|testing)/")
_TEST_FILE = re.compile(r"(^|/)(test_[^/]*\.py|[^/]*_test\.py|conftest\.py)$")
_DOC_SUFFIXES = (".md", ".rst", ".txt", ".adoc", ".png", ".svg", ".jpg", ".gif")
_CONFIG_SUFFIXES = (".cfg", ".ini", ".toml", ".yml", ".yaml", ".json", ".lock", ".in")
_CONFIG_NAMES = {"Makefile", "MANIFEST.in", ".gitignore", ".gitattributes", "LICENSE", "AUTHORS", "CHANGES", "tox.ini"}


class GitError(RuntimeError):
    """A git command failed; the message names the command and git's own words."""


def git(repo: Path, *args: str, input: bytes | None = None, check: bool = True) -> bytes:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    proc = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, env=env)
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args[:4])}: {proc.stderr.decode(errors='replace').strip()[-500:]}")
    return proc.stdout


def is_test_path(path: str) -> bool:
    return bool(_TEST_DIR.search(path) or _TEST_FILE.search(path))


def is_test_module(path: str) -> bool:
    """A file pytest collects by default (test_*.py or *_test.py)."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def is_docs_or_config(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return (
        path.startswith(("docs/", "doc/", ".github/"))
        or name.endswith(_DOC_SUFFIXES + _CONFIG_SUFFIXES)
        or name in _CONFIG_NAMES
    )


@dataclasses.dataclass(frozen=True)
class FileChange:
    path: str
    added: int  # lines; 0 for a binary file
    deleted: int
    binary: bool
    status: str  # A, M, D (renames are split into D + A)


@dataclasses.dataclass(frozen=True)
class Commit:
    sha: str
    parent: str | None
    date: str  # committer date, ISO 8601 UTC
    subject: str
    body: str


def first_parent_commits(repo: Path, rev_range: str, since: str | None, until: str | None) -> list[Commit]:
    """Commits of `rev_range` along first parents, oldest first (a merged PR is its merge commit)."""
    args = ["log", "--first-parent", "--reverse", "--format=%H%x00%P%x00%cI%x00%s%x00%b%x1e"]
    args += [f"--since={since}"] if since else []
    args += [f"--until={until}"] if until else []
    out = git(repo, *args, rev_range, "--").decode("utf-8", "replace")
    commits = []
    for record in out.split("\x1e"):
        record = record.strip("\n")
        if not record:
            continue
        sha, parents, date, subject, body = record.split("\x00", 4)
        first = parents.split()[0] if parents.split() else None
        commits.append(Commit(sha, first, utc(date), subject, body.strip()))
    return commits


def utc(date: str) -> str:
    from datetime import datetime

    return datetime.fromisoformat(date).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def changed_files(repo: Path, parent: str, commit: str) -> list[FileChange]:
    numstat = git(repo, "diff", "--no-renames", "--numstat", "-z", parent, commit).decode("utf-8", "replace")
    status = git(repo, "diff", "--no-renames", "--name-status", "-z", parent, commit).decode("utf-8", "replace")
    parts = status.split("\x00")
    kinds = {parts[i + 1]: parts[i][0] for i in range(0, len(parts) - 1, 2)}
    changes = []
    for entry in numstat.split("\x00"):
        if not entry:
            continue
        added, deleted, path = entry.split("\t", 2)
        binary = added == "-"
        changes.append(
            FileChange(path, 0 if binary else int(added), 0 if binary else int(deleted), binary, kinds.get(path, "M"))
        )
    return changes


def diff(repo: Path, parent: str, commit: str, paths: list[str]) -> bytes:
    """`git diff --binary` of `paths` (a patch `git apply` takes, binary files included)."""
    if not paths:
        return b""
    return git(repo, "diff", "--no-renames", "--binary", "--full-index", parent, commit, "--", *paths)


def write_tree(repo: Path, rev: str, dest: Path) -> None:
    """The files of `rev` into `dest` (created), without .git; submodules are left out."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="composer-jax-index-") as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"), LC_ALL="C")
        for args in (["read-tree", rev], ["checkout-index", "-a", f"--prefix={dest.resolve()}/"]):
            proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, env=env)
            if proc.returncode != 0:
                raise GitError(f"git {args[0]} {rev}: {proc.stderr.decode(errors='replace').strip()[-500:]}")


def apply(tree: Path, patch: bytes, *, check_only: bool = False) -> None:
    """`git apply` of `patch` onto the plain directory `tree` (GitError naming why it does not apply)."""
    if not patch:
        return
    args = ["git", "apply", "--whitespace=nowarn", *(["--check"] if check_only else []), "-"]
    # GIT_CEILING_DIRECTORIES: `tree` is no repository, and none above it may capture the paths
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.resolve().parent), LC_ALL="C")
    proc = subprocess.run(args, cwd=tree, input=patch, capture_output=True, env=env)
    if proc.returncode != 0:
        raise GitError(f"git apply: {proc.stderr.decode(errors='replace').strip()[-500:]}")


def remote_name(repo: Path) -> str:
    """`owner/name` from the origin remote's URL, else the checkout's directory name."""
    url = git(repo, "config", "--get", "remote.origin.url", check=False).decode().strip()
    match = re.search(r"[:/]([^/:]+)/([^/]+?)(?:\.git)?/?$", url)
    return f"{match.group(1)}/{match.group(2)}" if match else Path(repo).resolve().name


TEST_EXTRAS = ("test", "tests", "testing")
# PEP 735 [dependency-groups] read for a task's environment: the groups named like TEST_EXTRAS
# (names compared normalized, PEP 503); `dev` only where the project has none of those
DEV_GROUP = "dev"
REQUIREMENTS_FILES = ("requirements.txt", "requirements-test.txt", "requirements/test.txt", "test-requirements.txt")
_PROVIDED = re.compile(r"^\s*pytest\s*($|[<>=!~;\[])", re.I)  # the verifier's runner, always there


def show(repo: Path, rev: str, path: str) -> str | None:
    """The text of `path` at `rev`, or None when it is not there."""
    out = git(repo, "show", f"{rev}:{path}", check=False)
    return out.decode("utf-8", "replace") if out else None


def declared_requirements(repo: Path, rev: str) -> list[str]:
    """What the project at `rev` says it needs to run its tests: pyproject.toml's
    [project] dependencies, its test extras and its test dependency groups (`test_group_requirements`),
    else the first requirements file found; pytest itself left out (the verifier brings it). Local
    paths, editable and option lines are dropped. `DependencyGroupError` where the groups are malformed."""
    import tomllib

    lines: list[str] = []
    text = show(repo, rev, "pyproject.toml")
    if text:
        try:
            pyproject = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            pyproject = {}
        project = pyproject.get("project", {})
        deps = project.get("dependencies", [])
        extras = project.get("optional-dependencies", {})
        lines += [d for d in deps if isinstance(d, str)] if isinstance(deps, list) else []
        for name in TEST_EXTRAS:
            extra = extras.get(name, []) if isinstance(extras, dict) else []
            lines += [d for d in extra if isinstance(d, str)] if isinstance(extra, list) else []
        lines += test_group_requirements(pyproject.get("dependency-groups", {}))
    if not lines:
        for path in REQUIREMENTS_FILES:
            text = show(repo, rev, path)
            if text:
                lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
                break
    keep = [line for line in lines if line and not line.startswith(("-", ".", "/", "file:")) and "://" not in line]
    return sorted({line for line in keep if not _PROVIDED.match(line)})


class DependencyGroupError(ValueError):
    """A [dependency-groups] table that cannot be resolved (PEP 735); the message names the group."""


def _group_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_group_requirements(table: object) -> list[str]:
    """The requirements of pyproject.toml's PEP 735 `[dependency-groups]` `table` that a test run
    needs: the groups named test / tests / testing, else `dev` (names compared normalized), each
    with its `{include-group = "..."}` entries resolved recursively. A missing group, an entry that
    is neither a string nor an include, or an include cycle: `DependencyGroupError` naming it."""
    if not isinstance(table, dict) or not table:
        return []
    groups: dict[str, object] = {}
    for name, entries in table.items():
        key = _group_name(str(name))
        if key in groups:
            raise DependencyGroupError(f"[dependency-groups]: {name!r} names the same group as another (PEP 503)")
        groups[key] = entries
    chosen = [n for n in TEST_EXTRAS if n in groups] or [DEV_GROUP] * (DEV_GROUP in groups)
    lines: list[str] = []
    for name in chosen:
        lines += _resolve_group(groups, name, ())
    return lines


def _resolve_group(groups: dict[str, object], name: str, chain: tuple[str, ...]) -> list[str]:
    """`name`'s requirements with its includes expanded; `chain`: the groups that include it."""
    if name in chain:
        cycle = " -> ".join((*chain[chain.index(name) :], name))
        raise DependencyGroupError(f"[dependency-groups]: group {name!r} includes itself ({cycle})")
    entries = groups.get(name)
    if entries is None:
        via = f" (included by {chain[-1]!r})" if chain else ""
        raise DependencyGroupError(f"[dependency-groups]: no group {name!r}{via}; groups: {', '.join(groups)}")
    if not isinstance(entries, list):
        raise DependencyGroupError(f"[dependency-groups]: group {name!r} = {entries!r} must be a list")
    lines: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            lines.append(entry)
        elif isinstance(entry, dict) and list(entry) == ["include-group"] and isinstance(entry["include-group"], str):
            lines += _resolve_group(groups, _group_name(entry["include-group"]), (*chain, name))
        else:
            raise DependencyGroupError(
                f"[dependency-groups]: group {name!r} has entry {entry!r}; accepted: a requirement string "
                'or {include-group = "name"}'
            )
    return lines
