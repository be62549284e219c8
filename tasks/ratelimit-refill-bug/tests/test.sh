#!/usr/bin/env bash
# Verifier: runs with cwd /app; hidden tests at /tests (read-only); results in /logs/verifier.
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
export PYTHONPATH=/app
export PYTHONDONTWRITEBYTECODE=1
python3 -m pytest -q -p no:cacheprovider --rootdir=/tests \
    --junitxml=/logs/verifier/junit.xml /tests
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
exit 0
