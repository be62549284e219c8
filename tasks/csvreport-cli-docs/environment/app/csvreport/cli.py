"""Command line: python3 -m csvreport FILE --group-by COL --column COL [--agg sum|count|mean|max|min]."""
import argparse
import sys

from .aggregate import AGGREGATES, summarise
from .reader import read_rows


def build_parser():
    p = argparse.ArgumentParser(prog="csvreport", description="Summarise a CSV column by group.")
    p.add_argument("file", help="input CSV file with a header row")
    p.add_argument("--group-by", required=True, help="column whose values form the groups")
    p.add_argument("--column", required=True, help="numeric column to aggregate")
    p.add_argument("--agg", default="sum", choices=sorted(AGGREGATES), help="aggregate function (default sum)")
    p.add_argument("--delimiter", default=",", help="field separator (default ',')")
    p.add_argument("--precision", type=int, default=2, help="decimals in the output (default 2)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    rows = read_rows(args.file, args.delimiter)
    for group, value in summarise(rows, args.group_by, args.column, args.agg):
        print(f"{group}\t{value:.{args.precision}f}")
    return 0
