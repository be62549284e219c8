"""todo CLI: add / list / done."""
import argparse
import datetime
import sys

from . import storage
from .legacy import to_legacy_line
from .models import Task


def _date(text):
    try:
        return datetime.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None


def build_parser():
    p = argparse.ArgumentParser(prog="todo")
    p.add_argument("--file", default="todo.json")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add")
    a.add_argument("title")
    a.add_argument("--tag", action="append", default=[])
    a.add_argument("--due", type=_date, default=None, help="due date, YYYY-MM-DD")
    ls = sub.add_parser("list")
    ls.add_argument("--all", action="store_true", help="include finished tasks")
    ls.add_argument("--overdue", action="store_true", help="only open tasks past their due date")
    ls.add_argument("--today", type=_date, default=None, help=argparse.SUPPRESS)
    ls.add_argument("--legacy", action="store_true", help="deprecated: print in the old text format")
    d = sub.add_parser("done")
    d.add_argument("id", type=int)
    return p


def format_task(task):
    mark = "x" if task.done else " "
    tags = " ".join(f"#{t}" for t in task.tags)
    due = f"  due {task.due}" if task.due else ""
    return f"{task.id:>3} [{mark}] {task.title}" + (f"  {tags}" if tags else "") + due


def main(argv=None):
    args = build_parser().parse_args(argv)
    tasks = storage.load(args.file)
    if args.cmd == "add":
        task = Task(max((t.id for t in tasks), default=0) + 1, args.title, tags=args.tag, due=args.due)
        tasks.append(task)
        storage.save(args.file, tasks)
        print(f"added {task.id}")
    elif args.cmd == "list":
        for t in tasks:
            if t.done and not args.all:
                continue
            if args.overdue:
                today = args.today or datetime.date.today().isoformat()
                if t.done or not t.due or t.due >= today:
                    continue
            print(to_legacy_line(t) if args.legacy else format_task(t))
    elif args.cmd == "done":
        for t in tasks:
            if t.id == args.id:
                t.done = True
                storage.save(args.file, tasks)
                print(f"done {t.id}")
                return 0
        print(f"no task {args.id}", file=sys.stderr)
        return 1
    return 0
