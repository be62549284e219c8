#!/usr/bin/env bash
set -euo pipefail
cp -r /solution/app/. /app/
rm -f /app/todo/legacy.py
