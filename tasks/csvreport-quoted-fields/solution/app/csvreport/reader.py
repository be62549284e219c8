"""Reading CSV rows as dicts."""
import csv


def read_rows(path, delimiter=","):
    with open(path, encoding="utf-8-sig", newline="") as fh:
        return [row for row in csv.DictReader(fh, delimiter=delimiter) if any((v or "").strip() for v in row.values())]
