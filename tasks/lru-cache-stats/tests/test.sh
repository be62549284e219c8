#!/usr/bin/env bash
# Verifier: tests/run_tests.py runs the hidden tests on /app and writes /logs/verifier/verdicts.json
# (per-test verdicts: the reward) and reward.txt (1 iff every graded test passed).
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
python3 -I -S /tests/run_tests.py || echo 0 > /logs/verifier/reward.txt
exit 0
