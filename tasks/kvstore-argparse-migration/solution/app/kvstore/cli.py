"""kv CLI: kv [--db FILE] {get KEY | set KEY VALUE | del KEY | keys [--prefix P] [--json]}."""
import argparse
import json
import sys

from . import __version__
from .store import Store


def build_parser():
    parser = argparse.ArgumentParser(prog="kvstore", description="Tiny append-only key-value store.")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    parser.add_argument("--db", default="kv.jsonl", help="store file (default kv.jsonl)")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p = sub.add_parser("get", help="print a value")
    p.add_argument("key")
    p = sub.add_parser("set", help="store a value")
    p.add_argument("key")
    p.add_argument("value")
    p = sub.add_parser("del", help="delete a key")
    p.add_argument("key")
    p = sub.add_parser("keys", help="list keys")
    p.add_argument("--prefix", default="", help="only keys starting with this")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    store = Store(args.db)
    if args.cmd == "get":
        value = store.get(args.key)
        if value is None:
            print(f"not found: {args.key}", file=sys.stderr)
            return 1
        print(value)
    elif args.cmd == "set":
        store.set(args.key, args.value)
    elif args.cmd == "del":
        return 0 if store.delete(args.key) else 1
    elif args.cmd == "keys":
        keys = store.keys(args.prefix)
        print(json.dumps(keys) if args.json else "\n".join(keys))
    return 0
