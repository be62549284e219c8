"""`env mine` builds wherever `pip install` works, with no flags (issue 50, item 5): a project whose
environment needs a package that lives only on an HTTPS index at 127.0.0.1, behind a certificate
authority made for the test and named only in pip's configuration, is mined as the README shows
(`composer-jax env mine REPO --out DIR`); without the authority in the configuration the run's
summary names the untrusted certificate and the setting that changes it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support import minerepo, tls_index
from support.live_server import requires_bwrap

from composer_jax.env.mining.cli import mine_main
from composer_jax.env.sandbox import pip_sources

pytestmark = requires_bwrap


def _calc_needing_tinyfmt(repo: Path) -> None:
    repo.mkdir()
    minerepo.git(repo, "init", "-q", "-b", "main")
    minerepo.git(repo, "remote", "add", "origin", "https://github.com/example/calc.git")
    first = {
        "pyproject.toml": minerepo.PYPROJECT_V1,
        "calc/__init__.py": "",
        "calc/ops.py": minerepo.OPS_V1,
        "tests/test_ops.py": minerepo.TEST_OPS_V1,
    }
    minerepo.commit(repo, "Initial calc package", first, 1)
    change = {
        "pyproject.toml": minerepo.PYPROJECT_V2,
        "calc/fmt.py": minerepo.FMT,
        "tests/test_fmt.py": minerepo.TEST_FMT,
    }
    minerepo.commit(repo, "Show values with tinyfmt", change, 13)


def _only_this_pip_configuration(monkeypatch: pytest.MonkeyPatch, conf: Path) -> None:
    """pip reads `conf` (and the machine's global files, which it overrides), no PIP_* variable, no
    user configuration (pip skips it when PIP_CONFIG_FILE names a file), and no bundle variable
    that pip's requests would take over the configuration's `cert`."""
    for name in [k for k in os.environ if k.startswith("PIP_") or k in pip_sources.BUNDLE_VARIABLES]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))


def test_mined_with_no_flags_from_an_index_behind_its_own_authority(tmp_path, monkeypatch, capsys):
    ca, cert, key = tls_index.authority(tmp_path / "tls")
    wheels = sorted(minerepo.tinyfmt_wheelhouse(tmp_path / "wheels").glob("*.whl"))
    repo = tmp_path / "calc"
    _calc_needing_tinyfmt(repo)
    conf = tmp_path / "pip.conf"
    with tls_index.serve(wheels, cert, key) as (url, requests):
        conf.write_text(f"[global]\nindex-url = {url}\ncert = {ca}\n")
        _only_this_pip_configuration(monkeypatch, conf)
        # the premise: pip installs from it on this machine with no flags
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp_path / "dl"), "tinyfmt"],
            capture_output=True,
            text=True,
        )
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr
        args = [str(repo), "--out", str(tmp_path / "out"), "--rev-range", "HEAD~1..HEAD", "--runs", "1"]
        assert mine_main([*args, "--env-cache", str(tmp_path / "envs")]) == 0
        summary = capsys.readouterr().out
        assert "1 tasks written" in summary and "package sources" not in summary, summary
        assert requests[f"/files/{wheels[0].name}"] == 2  # pip download, then the environment's build
        (task,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
        assert tomllib.loads((task / "task.toml").read_text())["environment"]["requirements"] == ["tinyfmt"]

        # the same index, its authority not in the configuration: named in the summary, with the remedy
        conf.write_text(f"[global]\nindex-url = {url}\n")
        repo2 = tmp_path / "calc2"
        _calc_needing_tinyfmt(repo2)
        args = [str(repo2), "--out", str(tmp_path / "out2"), "--rev-range", "HEAD~1..HEAD", "--runs", "1"]
        assert mine_main([*args, "--env-cache", str(tmp_path / "envs2")]) == 0
    summary = capsys.readouterr().out
    assert "0 tasks written" in summary and "rejected      1  environment did not build" in summary, summary
    assert (
        "package sources: 1 build(s): a package source's certificate is not trusted: name its authority in "
        "pip's configuration (`pip config set global.cert BUNDLE`, or PIP_CERT)"
    ) in summary, summary


def test_the_bundle_pip_trusts_is_the_one_read(tmp_path, monkeypatch):
    """pip's HTTP library takes REQUESTS_CA_BUNDLE over pip's own `cert` (this machine sets it):
    `pip_sources.read` names the bundle pip actually verifies with, checked by pip download."""
    ca, cert, key = tls_index.authority(tmp_path / "tls")
    other, _, _ = tls_index.authority(tmp_path / "other")  # an authority that signed nothing here
    wheels = sorted(minerepo.tinyfmt_wheelhouse(tmp_path / "wheels").glob("*.whl"))
    conf = tmp_path / "pip.conf"
    with tls_index.serve(wheels, cert, key) as (url, _):
        conf.write_text(f"[global]\nindex-url = {url}\ncert = {other}\n")
        _only_this_pip_configuration(monkeypatch, conf)
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca))
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "0", "-d", str(tmp_path / "dl")]
        assert subprocess.run([*argv, "tinyfmt"], capture_output=True).returncode == 0
        read = pip_sources.read()
        assert (read.cert, read.origin["cert"]) == (str(ca), "REQUESTS_CA_BUNDLE")
        monkeypatch.delenv("REQUESTS_CA_BUNDLE")
        assert subprocess.run([*argv, "tinyfmt"], capture_output=True).returncode != 0
        assert pip_sources.read().cert == str(other)
