"""Clock-time reading: analog clock images rendered at chosen times, and a text-only variant.

Each record `i` draws its time and its look from `random.Random(f"{seed}:clock:{i}")`, then renders
with PIL drawing primitives only: the same options give the same PNG bytes (PIL writes no time
chunk; zlib is deterministic for a given level). Looks vary in face shape (round / square), colours,
tick marks (none / 12 / 60), numerals (none / arabic / roman), hand lengths, widths and colours, an
optional second hand, and image size (`min_size`..`max_size` pixels).

The answer text is "H:MM" with H in 1..12; the numeric answer is minutes past 12 on a 12-hour dial
(0..719), which is what the circular time-gap metric compares. `times` (a list of "H:MM") renders
those times in turn instead of random ones.

"clock_text" asks the same question in words, giving the two hands' angles, so text-only backbones
have the task too.
"""

from __future__ import annotations

import io
import math
import random

from .base import Example, Source

ROMAN = ["XII", "I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI"]
PALETTES = [  # (face, rim, ticks/numerals, hour hand, minute hand)
    ((255, 255, 255), (20, 20, 20), (20, 20, 20), (0, 0, 0), (0, 0, 0)),
    ((250, 240, 220), (120, 80, 40), (60, 40, 20), (60, 40, 20), (60, 40, 20)),
    ((20, 24, 40), (200, 200, 210), (230, 230, 240), (240, 240, 250), (120, 200, 255)),
    ((235, 245, 235), (30, 90, 40), (30, 90, 40), (20, 60, 30), (200, 40, 40)),
]
QUESTION = "What time does the clock show? Answer in H:MM format."


def parse_time(text: str) -> tuple[int, int]:
    h, m = text.split(":")
    hour, minute = int(h), int(m)
    if not (1 <= hour <= 12 and 0 <= minute <= 59):
        raise ValueError(f"clock: bad time {text!r}; expected H:MM with H in 1..12")
    return hour, minute


def time_text(hour: int, minute: int) -> str:
    return f"{hour}:{minute:02d}"


def minutes_past_twelve(hour: int, minute: int) -> int:
    return (hour % 12) * 60 + minute


def hand_angles(hour: int, minute: int) -> tuple[float, float]:
    """Clockwise degrees from 12 of the hour and minute hands."""
    return (hour % 12) * 30 + minute * 0.5, minute * 6.0


def render_clock(hour: int, minute: int, rng: random.Random, size: int) -> bytes:
    """PNG bytes of an analog clock at hour:minute, its look drawn from `rng`."""
    from PIL import Image, ImageDraw, ImageFont

    face, rim, tick, hour_c, min_c = rng.choice(PALETTES)
    background = rng.choice([(255, 255, 255), (230, 230, 230), (200, 215, 235)])
    square = rng.random() < 0.25
    ticks = rng.choice([0, 12, 60])
    numerals = rng.choice(["none", "arabic", "roman"])
    second_hand = rng.random() < 0.3
    hour_len, min_len = rng.uniform(0.45, 0.6), rng.uniform(0.7, 0.9)
    hour_w, min_w = rng.uniform(0.035, 0.06), rng.uniform(0.02, 0.035)

    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    c = size / 2
    r = size * 0.45
    box = [c - r, c - r, c + r, c + r]
    rim_w = max(1, round(size * 0.02))
    if square:
        draw.rectangle(box, fill=face, outline=rim, width=rim_w)
    else:
        draw.ellipse(box, fill=face, outline=rim, width=rim_w)

    def point(deg: float, frac: float) -> tuple[float, float]:
        a = math.radians(deg)
        return c + frac * r * math.sin(a), c - frac * r * math.cos(a)

    for k in range(ticks):
        major = ticks == 12 or k % 5 == 0
        draw.line([point(k * 360 / ticks, 0.82 if major else 0.88), point(k * 360 / ticks, 0.95)],
                  fill=tick, width=max(1, round(size * (0.015 if major else 0.006))))
    if numerals != "none":
        font = ImageFont.load_default(size=max(8, round(size * 0.09)))
        for k in range(12):
            label = ROMAN[k] if numerals == "roman" else str(12 if k == 0 else k)
            x, y = point(k * 30, 0.68)
            draw.text((x, y), label, fill=tick, font=font, anchor="mm")

    hour_deg, min_deg = hand_angles(hour, minute)
    draw.line([(c, c), point(hour_deg, hour_len)], fill=hour_c, width=max(2, round(size * hour_w)))
    draw.line([(c, c), point(min_deg, min_len)], fill=min_c, width=max(1, round(size * min_w)))
    if second_hand:
        draw.line([(c, c), point(rng.randrange(60) * 6, 0.85)], fill=(200, 30, 30),
                  width=max(1, round(size * 0.008)))
    dot = max(2, size * 0.03)
    draw.ellipse([c - dot, c - dot, c + dot, c + dot], fill=hour_c)

    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


class Clock(Source):
    kind = "clock"
    has_images = True
    defaults = {"n": 1000, "seed": 0, "min_size": 96, "max_size": 256, "times": None}

    def _iter_raw(self):
        times = self.opts["times"]
        n = len(times) if times and self.opts["n"] is None else int(self.opts["n"])
        for i in range(n):
            yield f"{self.kind}#{i}", i

    def fingerprint(self):
        return {"kind": self.kind, "options": self.opts, "limit": self.cfg.limit, "generator": 1}

    def _time(self, i: int, rng: random.Random) -> tuple[int, int]:
        times = self.opts["times"]
        if times:
            return parse_time(times[i % len(times)])
        return rng.randint(1, 12), rng.randrange(60)

    def to_example(self, raw, ref):
        i = raw
        rng = random.Random(f"{self.opts['seed']}:clock:{i}")
        hour, minute = self._time(i, rng)
        size = rng.randint(int(self.opts["min_size"]), int(self.opts["max_size"]))
        image = render_clock(hour, minute, rng, size)
        text = time_text(hour, minute)
        return self.finish(Example(prompt=QUESTION, target=text,
                                   answer=float(minutes_past_twelve(hour, minute)),
                                   answer_text=text, image=image))


class ClockText(Clock):
    kind = "clock_text"
    has_images = False
    defaults = {"n": 1000, "seed": 0, "times": None}

    def to_example(self, raw, ref):
        i = raw
        rng = random.Random(f"{self.opts['seed']}:clock:{i}")
        hour, minute = self._time(i, rng)
        hour_deg, min_deg = hand_angles(hour, minute)
        prompt = (f"On an analog clock the hour hand points {hour_deg:g} degrees and the minute hand "
                  f"{min_deg:g} degrees clockwise from 12. {QUESTION}")
        text = time_text(hour, minute)
        return self.finish(Example(prompt=prompt, target=text,
                                   answer=float(minutes_past_twelve(hour, minute)), answer_text=text))
