"""support/bwrap.py's decision for a test that needs bubblewrap: it runs where bwrap is installed;
where it is missing it fails if `make system-deps` could install it (root with apt-get: the step was
left out) and is skipped elsewhere. Every case of the three facts, worked by hand."""

from __future__ import annotations

import itertools

import pytest
from support import bwrap
from support.bwrap import missing_bwrap_outcome, require_bwrap


@pytest.mark.parametrize(("root", "apt_get"), list(itertools.product([False, True], repeat=2)))
def test_installed_bubblewrap_always_runs(root, apt_get):
    assert missing_bwrap_outcome(have_bwrap=True, root=root, apt_get=apt_get) == "run"


def test_missing_bubblewrap_fails_only_where_make_system_deps_installs_it():
    assert missing_bwrap_outcome(have_bwrap=False, root=True, apt_get=True) == "fail"
    assert missing_bwrap_outcome(have_bwrap=False, root=True, apt_get=False) == "skip"  # no apt-get
    assert missing_bwrap_outcome(have_bwrap=False, root=False, apt_get=True) == "skip"  # cannot install
    assert missing_bwrap_outcome(have_bwrap=False, root=False, apt_get=False) == "skip"


def test_require_bwrap_says_what_to_run(monkeypatch):
    monkeypatch.setattr(bwrap, "HAVE_BWRAP", False)
    monkeypatch.setattr(bwrap.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    with pytest.raises(pytest.fail.Exception, match="run `make system-deps`"):
        require_bwrap()
    monkeypatch.setattr(bwrap.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="bubblewrap"):
        require_bwrap()
    monkeypatch.setattr(bwrap, "HAVE_BWRAP", True)
    require_bwrap()  # installed: returns
