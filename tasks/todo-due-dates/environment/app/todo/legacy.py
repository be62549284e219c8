"""Deprecated: the 0.2-era plain-text format ("[x] title #tag"). Kept for `list --legacy`."""


def to_legacy_line(task):
    mark = "[x]" if task.done else "[ ]"
    tags = "".join(f" #{t}" for t in task.tags)
    return f"{mark} {task.title}{tags}"
