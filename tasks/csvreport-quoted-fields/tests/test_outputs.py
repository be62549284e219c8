import subprocess
import sys

from csvreport.reader import read_rows

DATA = ('\ufeffcustomer,region,amount,note\r\n'
        '"Acme, Inc.",EU,100.5,"said ""hi"""\r\n'
        '\r\n'
        'Bolt,US,20,"two\r\nlines"\r\n'
        '"Acme, Inc.",EU,0.5,\r\n'
        'Zed,"US",x,bad\r\n')


def write(tmp_path, text, name="d.csv"):
    p = tmp_path / name
    p.write_bytes(text.encode("utf-8"))
    return p


def test_rows(tmp_path):
    rows = read_rows(write(tmp_path, DATA))
    assert [r["customer"] for r in rows] == ["Acme, Inc.", "Bolt", "Acme, Inc.", "Zed"]
    assert rows[0]["note"] == 'said "hi"'
    assert rows[1]["note"] == "two\r\nlines" or rows[1]["note"] == "two\nlines"
    assert list(rows[0]) == ["customer", "region", "amount", "note"]


def test_semicolon_delimiter(tmp_path):
    rows = read_rows(write(tmp_path, 'a;b\n"1;2";3\n'), delimiter=";")
    assert rows == [{"a": "1;2", "b": "3"}]


def test_cli_end_to_end(tmp_path):
    p = write(tmp_path, DATA)
    out = subprocess.run([sys.executable, "-m", "csvreport", str(p), "--group-by", "customer", "--column",
                          "amount"], cwd="/app", capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["Acme, Inc.\t101.00", "Bolt\t20.00"]
