"""Each source adapter on fixtures written here (the answer reader: tests/data_prep/test_answers.py)."""

import io
import json
import random
from fractions import Fraction

import pytest
from tests.data_prep.helpers import GSM8K_ROWS, png_bytes, write_csv, write_jsonl, write_parquet

from data_prep.sources import BadRecord, SourceConfig, make_source
from data_prep.sources.clock import hand_angles


def examples(cfg):
    """[(ref, Example or BadRecord)] for every record of a source."""
    src = make_source(cfg)
    out = []
    for ref, raw in src.iter_raw():
        try:
            out.append((ref, src.to_example(raw, ref)))
        except BadRecord as e:
            out.append((ref, e))
    return out


def test_gsm8k(tmp_path):
    path = write_jsonl(str(tmp_path / "train.jsonl"), GSM8K_ROWS + [{"question": "q?", "answer": "no marker"}])
    got = examples(SourceConfig("gsm8k", path=path))
    assert [r for r, _ in got] == [f"train.jsonl:{i}" for i in range(1, 6)]
    answers = [e.answer for _, e in got[:4]]
    assert answers == [72.0, 1600.0, 10.0, -3.0]
    assert got[1][1].answer_text == "1,600"
    assert got[0][1].target.endswith("#### 72") and "<<48/2=24>>" in got[0][1].target
    assert got[0][1].prompt.startswith("Natalia sold clips")
    assert isinstance(got[4][1], BadRecord) and got[4][1].reason == "no_answer"
    stripped = examples(SourceConfig("gsm8k", path=path, options={"strip_calculator": True}))
    assert "<<" not in stripped[0][1].target and stripped[0][1].answer == 72.0


def test_svamp_json_array(tmp_path):
    rows = [{"ID": "chal-1", "Body": "Each pack has 12 pencils.", "Question": "How many in 3 packs?",
             "Equation": "( 12.0 * 3.0 )", "Answer": 36.0, "Type": "Multiplication"},
            {"ID": "chal-2", "Body": "", "Question": "What is 7 minus 9?", "Equation": "( 7.0 - 9.0 )",
             "Answer": -2}]
    path = tmp_path / "SVAMP.json"
    path.write_text(json.dumps(rows))
    got = examples(SourceConfig("svamp", path=str(path)))
    (ref0, e0), (_, e1) = got
    assert ref0 == "SVAMP.json#0"
    assert e0.prompt == "Each pack has 12 pencils. How many in 3 packs?"
    assert e0.answer == 36.0 and e0.target == "( 12.0 * 3.0 ) = 36\n#### 36"
    assert e1.prompt == "What is 7 minus 9?" and e1.answer == -2.0


def test_deepmind_math_text_files(tmp_path):
    d = tmp_path / "train-easy"
    d.mkdir()
    (d / "arithmetic__add_or_sub.txt").write_text("What is 2 + -5?\n-3\nCalculate 0.5 - 1.\n-0.5\n")
    (d / "arithmetic__div.txt").write_text("Divide -3 by 6.\n-1/2\n")
    (d / "algebra__linear_1d.txt").write_text("Solve 2*x = 4.\n2\n")
    got = examples(SourceConfig("deepmind_math", path=str(tmp_path)))
    assert [r for r, _ in got] == ["train-easy/arithmetic__add_or_sub.txt:1",
                                   "train-easy/arithmetic__add_or_sub.txt:3",
                                   "train-easy/arithmetic__div.txt:1"]
    assert [e.answer for _, e in got] == [-3.0, -0.5, -0.5]
    assert got[2][1].target == "-1/2"
    bad = tmp_path / "odd" / "arithmetic__mul.txt"
    bad.parent.mkdir()
    bad.write_text("What is 2*3?\n6\nWhat is 4*4?\n")
    with pytest.raises(ValueError, match=r"arithmetic__mul.txt:3"):
        examples(SourceConfig("deepmind_math", path=str(bad.parent)))


# Written in the style of DeepMind's generator (its arithmetic modules): answers that are one number,
# surds, and numerals in another base.
DEEPMIND_MIXED = {
    "arithmetic__add_or_sub_in_base.txt": "In base 16, what is -1a3 + -1778?\n-191b\n"
                                          "In base 2, what is 1011 + 1011?\n10110\n"
                                          "In base 10, what is 12 + -20?\n-8\n",
    "arithmetic__simplify_surd.txt": "Simplify (-2 + sqrt(112) + -12)*2.\n-28 + 8*sqrt(7)\n"
                                     "Simplify sqrt(68)/(sqrt(4)*3) + sqrt(17)*2/3.\n7*sqrt(17)/6\n",
    "arithmetic__mul.txt": "What is -0.4 times 5?\n-2\n",
}


def _write_deepmind(root):
    d = root / "train-easy"
    d.mkdir()
    for name, text in DEEPMIND_MIXED.items():
        (d / name).write_text(text)
    return str(root)


def test_deepmind_math_keeps_surds_and_other_bases(tmp_path):
    got = dict(examples(SourceConfig("deepmind_math", path=_write_deepmind(tmp_path))))
    ex = {ref.split("/")[-1]: e for ref, e in got.items()}
    assert len(ex) == 6 and not any(isinstance(e, BadRecord) for e in ex.values())
    b = "arithmetic__add_or_sub_in_base.txt"
    s = "arithmetic__simplify_surd.txt"
    # (answer, answer_text, number_spans) per row, written by hand
    assert [(ex[k].answer, ex[k].answer_text, ex[k].number_spans) for k in
            (f"{b}:1", f"{b}:3", f"{b}:5", f"{s}:1", f"{s}:3", "arithmetic__mul.txt:1")] == [
        (None, "-191b", False), (None, "10110", False), (-8.0, "-8", True),
        (None, "-28 + 8*sqrt(7)", True), (None, "7*sqrt(17)/6", True), (-2.0, "-2", True)]
    strict = examples(SourceConfig("deepmind_math", path=str(tmp_path), options={"require_answer": True}))
    reasons = [e.reason if isinstance(e, BadRecord) else e.answer for _, e in strict]
    assert sorted(map(str, reasons)) == sorted(["no_answer"] * 4 + ["-8.0", "-2.0"])


@pytest.mark.parametrize("module", ["add_or_sub", "mul", "div", "mixed"])
def test_arithmetic_generator_is_correct_and_deterministic(module):
    opts = {"module": module, "n": 60, "seed": 3, "max_digits": 4, "terms": 3}
    got = examples(SourceConfig("arithmetic", options=opts))
    again = examples(SourceConfig("arithmetic", options=opts))
    assert [e.prompt for _, e in got] == [e.prompt for _, e in again]
    for _, e in got:
        expr = e.prompt
        for word in ("What is ", "Calculate ", "Evaluate ", "Multiply ", "Divide "):
            expr = expr.replace(word, "")
        expr = expr.rstrip(".?").replace(" times ", "*").replace(" divided by ", "/")
        if module == "mul" and " and " in expr:
            expr = expr.replace(" and ", "*")
        if module == "div" and " by " in expr:
            expr = expr.replace(" by ", "/")
        assert Fraction(eval(expr)).limit_denominator(10**9) == Fraction(e.target), e.prompt
        assert e.answer == float(Fraction(e.target))
    assert len({e.prompt for _, e in got}) > 40  # draws differ between records


def test_arithmetic_knobs():
    got = examples(SourceConfig("arithmetic", options={"module": "add_or_sub", "n": 50, "min_digits": 5,
                                                       "max_digits": 5, "negatives": False, "terms": 2}))
    for _, e in got:
        nums = [int(t) for t in e.prompt.rstrip(".?").split() if t.isdigit()]
        assert len(nums) == 2 and all(10000 <= n <= 99999 for n in nums)
    dec = examples(SourceConfig("arithmetic", options={"module": "mul", "n": 20, "decimals": 2}))
    assert any("." in e.target for _, e in dec)
    with pytest.raises(ValueError, match="unknown option"):
        make_source(SourceConfig("arithmetic", options={"modul": "mul"}))


def test_clock_images(tmp_path):
    from PIL import Image

    cfg = SourceConfig("clock", options={"n": 12, "seed": 1, "min_size": 64, "max_size": 160})
    got = examples(cfg)
    again = examples(cfg)
    sizes = set()
    for (_, e), (_, e2) in zip(got, again):
        assert e.image == e2.image  # deterministic PNG bytes
        im = Image.open(io.BytesIO(e.image))
        assert im.format == "PNG" and 64 <= im.width <= 160 and im.width == im.height
        sizes.add(im.width)
        h, m = map(int, e.target.split(":"))
        assert 1 <= h <= 12 and 0 <= m <= 59 and len(e.target.split(":")[1]) == 2
        assert e.answer == (h % 12) * 60 + m
    assert len(sizes) > 3 and len({e.image for _, e in got}) == 12
    fixed = examples(SourceConfig("clock", options={"n": 2, "times": ["3:00", "12:45"], "seed": 0}))
    assert [e.target for _, e in fixed] == ["3:00", "12:45"] and fixed[1][1].answer == 45.0


def test_clock_hands_point_at_the_time():
    """The minute hand's far end is drawn where the time says: check the pixel colours along it."""
    from PIL import Image

    from data_prep.sources.clock import render_clock

    for minute in (0, 15, 30, 45):
        png = render_clock(6 if minute != 30 else 3, minute, random.Random(5), 200)
        im = Image.open(io.BytesIO(png)).convert("L")
        _, deg = hand_angles(6, minute)
        import math
        a = math.radians(deg)
        # half-way along the minute hand, away from where the hour hand could be
        x, y = 100 + 0.4 * 90 * math.sin(a), 100 - 0.4 * 90 * math.cos(a)
        opposite = 100 - 0.4 * 90 * math.sin(a), 100 + 0.4 * 90 * math.cos(a)
        hand, face = im.getpixel((round(x), round(y))), im.getpixel(tuple(map(round, opposite)))
        if minute != 30:  # at 6:30 / 3:30 the hour hand is elsewhere: the opposite side is face
            assert hand != face


def test_clock_text():
    got = examples(SourceConfig("clock_text", options={"n": 5, "times": ["3:30"]}))
    e = got[0][1]
    assert "105 degrees" in e.prompt and "180 degrees" in e.prompt and e.target == "3:30"
    assert e.image is None and e.answer == 210.0


def test_chartqa_parquet_and_jsonl_images(tmp_path):
    good = png_bytes()
    rows = [{"image": {"bytes": good, "path": None}, "query": "What is the peak value?", "label": ["42.5"]},
            {"image": {"bytes": good, "path": None}, "query": "Which country?", "label": ["France"]},
            {"image": {"bytes": good[: len(good) // 2], "path": None}, "query": "Broken?", "label": ["3"]}]
    path = write_parquet(str(tmp_path / "chartqa.parquet"), rows)
    got = examples(SourceConfig("chartqa", path=path))
    assert got[0][1].answer == 42.5 and got[0][1].image == good and got[0][1].target == "42.5"
    assert got[1][1].reason == "no_answer"
    assert got[2][1].reason == "broken_image"
    kept = examples(SourceConfig("chartqa", path=path, options={"require_answer": False}))
    assert kept[1][1].answer is None and kept[1][1].target == "France"
    # JSONL with image paths relative to the file
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(good)
    jl = write_jsonl(str(tmp_path / "cq.jsonl"), [{"image": "imgs/a.png", "query": "q", "label": "7"},
                                                 {"image": "imgs/missing.png", "query": "q", "label": "7"}])
    got = examples(SourceConfig("chartqa", path=jl))
    assert got[0][1].image == good and got[1][1].reason == "broken_image"


def test_generic_formats(tmp_path):
    rows = [{"q": "How many?", "a": "There are 1,204 in total.", "n": "1204"},
            {"q": "Sum?", "a": "2 + 2 = 4\n#### 4", "n": "4"}]
    opts = {"prompt_field": "q", "target_field": "a"}
    for path in (write_jsonl(str(tmp_path / "x.jsonl"), rows), write_parquet(str(tmp_path / "x.parquet"), rows),
                 write_csv(str(tmp_path / "x.csv"), rows)):
        got = examples(SourceConfig("generic", path=path, options=opts))
        assert [e.answer for _, e in got] == [1204.0, 4.0], path
        assert got[0][1].prompt == "How many?"
        with_field = examples(SourceConfig("generic", path=path, options={**opts, "answer_field": "n"}))
        assert [e.answer for _, e in with_field] == [1204.0, 4.0]
    csv_refs = [r for r, _ in examples(SourceConfig("generic", path=str(tmp_path / "x.csv"), options=opts))]
    assert csv_refs == ["x.csv:2", "x.csv:3"]
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"q": "x"}], raw_lines=["{not json", "[1, 2]"])
    got = examples(SourceConfig("generic", path=bad, options=opts))
    assert [(r, e.reason) for r, e in got] == [("bad.jsonl:1", "missing_field"), ("bad.jsonl:2", "invalid_json"),
                                               ("bad.jsonl:3", "invalid_json")]
    assert "'a'" in got[0][1].detail


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        examples(SourceConfig("gsm8k", path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "broken.json").write_text('[{"a": 1},\n {"b": ')
    with pytest.raises(ValueError, match=r"broken.json.*line 2"):
        examples(SourceConfig("svamp", path=str(tmp_path / "broken.json")))
