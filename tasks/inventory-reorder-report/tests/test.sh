#!/usr/bin/env bash
# Verifier: runs with cwd /app; hidden tests at /tests (read-only); results in /logs/verifier.
# pytest is imported before /app joins sys.path (python -I: no PYTHONPATH, user site or cwd), so
# nothing in the workspace can stand in for it; only this script writes the reward, after every
# process the tests started has ended.
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
export PYTHONPATH=/app
export PYTHONDONTWRITEBYTECODE=1
python3 -I -c 'import sys, pytest; sys.path.insert(0, "/app"); sys.exit(pytest.console_main())' \
    -q -p no:cacheprovider --rootdir=/tests --junitxml=/logs/verifier/junit.xml /tests
rc=$?
if [ "${SANDBOX_PID_NAMESPACE:-}" = 1 ]; then kill -KILL -1 2>/dev/null; fi
chmod u+rwx /logs/verifier && rm -rf /logs/verifier/reward.txt
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
exit 0
