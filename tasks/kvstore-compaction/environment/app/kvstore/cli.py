"""kv CLI (optparse): kv [--db FILE] get KEY | set KEY VALUE | del KEY | keys [--prefix P] [--json]."""
import json
import optparse
import sys

from .store import Store


def main(argv=None):
    parser = optparse.OptionParser(usage="%prog [--db FILE] get KEY | set KEY VALUE | del KEY | keys")
    parser.add_option("--db", dest="db", default="kv.jsonl", help="store file")
    parser.add_option("--prefix", dest="prefix", default="", help="keys: only keys starting with this")
    parser.add_option("--json", dest="json", action="store_true", default=False, help="keys: print a JSON list")
    opts, args = parser.parse_args(argv)
    if not args:
        parser.error("missing command")
    store = Store(opts.db)
    cmd, rest = args[0], args[1:]
    if cmd == "get" and len(rest) == 1:
        value = store.get(rest[0])
        if value is None:
            print(f"not found: {rest[0]}", file=sys.stderr)
            return 1
        print(value)
    elif cmd == "set" and len(rest) == 2:
        store.set(rest[0], rest[1])
    elif cmd == "del" and len(rest) == 1:
        return 0 if store.delete(rest[0]) else 1
    elif cmd == "keys" and not rest:
        keys = store.keys(opts.prefix)
        print(json.dumps(keys) if opts.json else "\n".join(keys))
    else:
        parser.error(f"bad command: {' '.join(args)}")
    return 0
