#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")"
python3 tools/check_version.py
python3 -m pytest -q
python3 -m todo --version
