"""python3 -m inventory.migrate OLD.csv NEW.json: convert a legacy CSV inventory to JSON."""
import sys

from .storage import load, save


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python3 -m inventory.migrate OLD.csv NEW.json", file=sys.stderr)
        return 2
    save(load(argv[0]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
