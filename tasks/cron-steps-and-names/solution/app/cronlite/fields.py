"""Single cron fields: '*', '5', '1-5', '1,15,30', steps ('*/15', '1-30/5', '5/10') and names."""

BOUNDS = {"minute": (0, 59), "hour": (0, 23), "day": (1, 31), "month": (1, 12), "weekday": (0, 7)}
NAMES = {
    "month": {m: i for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], 1)},
    "weekday": {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])},
}


def _value(text, name):
    names = NAMES.get(name, {})
    if text.lower() in names:
        return names[text.lower()]
    if not text.isdigit():
        raise ValueError(f"{name}: bad value {text!r}")
    return int(text)


def parse_field(text, name):
    lo, hi = BOUNDS[name]
    values = set()
    for part in text.split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/", 1)
            if not step_text.isdigit() or int(step_text) < 1:
                raise ValueError(f"{name}: bad step {step_text!r}")
            step = int(step_text)
        if part == "*":
            start, end = lo, hi
        elif "-" in part:
            a, b = part.split("-", 1)
            start, end = _value(a, name), _value(b, name)
        else:
            start = _value(part, name)
            end = hi if step > 1 else start
        if not (lo <= start <= end <= hi):
            raise ValueError(f"{name}: {part!r} out of range {lo}-{hi}")
        values.update(range(start, end + 1, step))
    if name == "weekday" and 7 in values:
        values.discard(7)
        values.add(0)
    return frozenset(values)
