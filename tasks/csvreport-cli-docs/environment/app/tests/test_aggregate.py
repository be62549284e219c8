from csvreport.aggregate import summarise


def test_sum():
    rows = [{"g": "a", "v": "1"}, {"g": "a", "v": "2"}, {"g": "b", "v": "x"}]
    assert summarise(rows, "g", "v") == [("a", 3.0)]
