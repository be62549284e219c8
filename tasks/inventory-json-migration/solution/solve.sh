#!/usr/bin/env bash
set -euo pipefail
cp -r /solution/app/. /app/
cd /app
python3 -m inventory.migrate data/stock.csv data/stock.json
rm data/stock.csv
