"""The package sources a build takes from the machine's pip configuration (env/sandbox/pip_sources.py,
issue 50 item 5): read as pip reads them (pip's own `pip install` is the oracle for the precedence
of files, sections and environment variables), and turned into a sandboxed build's options."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from composer_jax.env.sandbox import pip_sources as ps


def _pip_env(conf: Path, **extra: str) -> dict[str, str]:
    """The environment with no PIP_* variable, no bundle variable pip's requests takes over pip's
    `cert` (this machine sets REQUESTS_CA_BUNDLE), PIP_CONFIG_FILE=conf and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ps.BUNDLE_VARIABLES}
    return env | {"PIP_CONFIG_FILE": str(conf), **extra}


def _looking_in(env: dict[str, str]) -> tuple[list[str], list[str]]:
    """What pip install itself says it looks in (its "Looking in indexes/links" lines)."""
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "cj-no-such-project-xyz"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120).stdout
    found = {m[0]: m[1].split(", ") for m in re.findall(r"Looking in (indexes|links): (.*)", out)}
    return found.get("indexes", []), found.get("links", [])


def test_read_takes_what_pip_install_takes(tmp_path):
    """[global], then [install], then PIP_* variables, a later one winning, as pip install applies
    them: checked against pip install's own report of where it looks."""
    dirs = {name: tmp_path / name for name in ("a", "b", "c", "links1", "links2")}
    for d in dirs.values():
        d.mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(
        f"[global]\nindex-url = {dirs['a'].as_uri()}\nextra-index-url = {dirs['b'].as_uri()}\n"
        f"find-links = {dirs['links1']}\ncert = {tmp_path / 'ca.pem'}\n"
        f"[install]\nfind-links = {dirs['links2']}\ntrusted-host = mirror.corp\n"
    )
    env = _pip_env(conf, PIP_EXTRA_INDEX_URL=f"{dirs['c'].as_uri()} {dirs['b'].as_uri()}")
    got = ps.read(environ=env)
    indexes, links = _looking_in(env)
    assert [got.index_url, *got.extra_index_urls] == indexes == [dirs[k].as_uri() for k in "acb"]
    assert list(got.find_links) == links == [str(dirs["links2"])]
    assert got.cert == str(tmp_path / "ca.pem") and got.trusted_hosts == ("mirror.corp",)
    assert {k: got.origin[k] for k in ("index-url", "extra-index-url", "find-links", "cert", "trusted-host")} == {
        "index-url": "global", "extra-index-url": ":env:", "find-links": "install", "cert": "global",
        "trusted-host": "install",
    }  # fmt: skip
    # nothing configured (PIP_CONFIG_FILE=/dev/null: pip reads no file): PyPI, and no bundle of its own
    plain = ps.read(environ=_pip_env(Path(os.devnull)))
    assert (plain.index_url, plain.extra_index_urls, plain.cert) == (ps.PYPI, (), None)


def test_no_index_from_the_environment():
    got = ps.parse_config_list("global.index-url='https://m.corp/simple'\n:env:.no-index='yes'\n")
    assert got.no_index and ps.plan(got).pip_args[:1] == ("--no-index",)


def test_the_plan_binds_local_sources_and_lists_network_hosts(tmp_path):
    (tmp_path / "mirror" / "simple").mkdir(parents=True)
    (tmp_path / "mirror" / "files").mkdir()
    (tmp_path / "wheels").mkdir()
    (tmp_path / "ca.pem").write_text("not read here")
    sources = ps.PipSources(
        index_url="https://pypi.org/simple",
        extra_index_urls=((tmp_path / "mirror" / "simple").as_uri(), "http://10.0.0.5:8080/simple"),
        find_links=(str(tmp_path / "wheels"),),
        cert=str(tmp_path / "ca.pem"),
        trusted_hosts=("10.0.0.5",),
    )
    plan = ps.plan(sources)
    seen = ps.SOURCES_MOUNT + str(tmp_path)
    assert plan.pip_args == (
        "--index-url", "https://pypi.org/simple",
        "--extra-index-url", f"file://{seen}/mirror/simple",
        "--extra-index-url", "http://10.0.0.5:8080/simple",
        "--find-links", f"{seen}/wheels",
        "--cert", f"{seen}/ca.pem",
        "--trusted-host", "10.0.0.5",
    )  # fmt: skip
    assert plan.uv_args == (
        *plan.pip_args[:8], "--cert", f"{seen}/ca.pem", "--allow-insecure-host", "10.0.0.5",
        "--index-strategy", "unsafe-best-match",
    )  # fmt: skip
    # a file:// index is bound with its parent (where `files/` lies), each path once
    assert dict(plan.binds) == {
        tmp_path / "mirror": f"{seen}/mirror",
        tmp_path / "wheels": f"{seen}/wheels",
        tmp_path / "ca.pem": f"{seen}/ca.pem",
    }
    assert plan.hosts == {("pypi.org", 443), ("files.pythonhosted.org", 443), ("10.0.0.5", 8080)}
    # without a bundle, uv trusts the system store (pip, its default)
    bare = ps.plan(ps.PipSources("https://m.corp/simple"))
    assert "--system-certs" in bare.uv_args and "--cert" not in bare.pip_args
    assert bare.hosts == {("m.corp", 443)}


def test_a_bind_inside_another_is_not_repeated(tmp_path):
    (tmp_path / "top" / "simple").mkdir(parents=True)
    (tmp_path / "top" / "ca.pem").write_text("")
    plan = ps.plan(ps.PipSources((tmp_path / "top" / "simple").as_uri(), cert=str(tmp_path / "top" / "ca.pem")))
    assert [host for host, _ in plan.binds] == [tmp_path / "top"]


@pytest.mark.parametrize(
    "sources, fragment",
    [
        (
            ps.PipSources(cert="/nonexistent/ca.pem", origin={"cert": ":env:"}),
            "(:env:) names cert '/nonexistent/ca.pem'",
        ),
        (ps.PipSources("ftp://mirror/simple"), "names index-url 'ftp://mirror/simple': expected an http://"),
        (
            ps.PipSources(find_links=("/nonexistent/wheels",)),
            "find-links '/nonexistent/wheels': /nonexistent/wheels does",
        ),
    ],
)
def test_a_source_a_build_cannot_use_is_named(sources, fragment):
    with pytest.raises(ps.PipConfigError, match=re.escape(fragment)):
        ps.plan(sources)
