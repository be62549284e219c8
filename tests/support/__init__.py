"""Helpers the tests share: not tests themselves (pytest collects no `test_*.py` here).

Imported as `from support.minerepo import ...` or `from support import minerepo`: tests/ is on
sys.path because pytest (rootdir, prepend import mode) inserts the directory of tests/conftest.py.
Scripts run in child processes (`publish_worker.py`, `scatter_worker.py`, `openenv_episode.py`,
`harbor_oracle.py`) are started by path and import nothing from here.
"""
