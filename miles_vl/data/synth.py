"""Procedural problems drawn with PIL, exact answers, deterministic given a seed: geo3k-style diagrams and polygon
questions (one image each), and a video task (a short clip of a moving shape).

    miles-vl data synth data/synth.parquet --n 256 --seed 0                  # a geometry3k-layout parquet file
    miles-vl data synth data/motion.parquet --n 256 --task motion            # the video task (a `videos` column)
    problems = generate_problems(8, seed=0)                      # SynthProblem: problem, answer, params, image
    problems = generate_problems(8, seed=0, task="polygon_sides")
    clip = generate_motion_problem(0, seed=0)                    # SynthVideoProblem: problem, answer, params, frames

Six tasks (`TASKS`: the names `data.synthetic_task` and `miles-vl data synth --task` take), five of images and one
of videos. `geometry` (the default): four kinds, cycled (problem i has kind KINDS[i % 4]), every number drawn to
scale:

    triangle_angle   a triangle with two interior angles labelled, the third is x°        answer: 180 - a - b
    right_triangle   a right triangle with two sides labelled, the third is x              answer: Pythagoras
    parallel_lines   two parallel lines m, n and a transversal; one angle given, one is x° answer: x or 180 - x
    circle           a circle with its radius or diameter labelled; circumference or area answer: to the tenth

`polygon_colour` and `polygon_sides`: one filled regular polygon (3 to 6 sides) of random size, position and small
tilt on white, and a multiple-choice question with the same text for every problem, so that the answer is in the
pixels only and a model shown blank images cannot beat chance (1/4):

    polygon_colour   "What colour is the polygon? Choices: A. red, B. green, C. blue, D. black."   answer: the letter
                     (problem i has colour i % 4; the side count is random)
    polygon_sides    "How many sides does the polygon have? Choices: 3, 4, 5, 6."                  answer: 3 to 6
                     (problem i has SIDES[i % 4]; the fill colour is random)

`background_colour`: the same polygon drawn white on a background of colour i % 4, "What colour is the background?
Choices: A. red, B. green, C. blue, D. black." (answer: the letter). Most of the image carries the answer (the polygon
covers 15-30 % of it), which is what lets the tiny random-init job (configs/vision_tiny_cpu.yaml) learn it by GRPO in
a few minutes on 2 CPU cores; on polygon_colour, where the answer sits in the polygon only, it did not
(docs/benchmarks.md).

Trained supervised (cross-entropy on the answer token, 60 steps of 16 images, 2 CPU cores), the tiny random-init
Qwen3-VL tells the fill colour of these polygons apart (~0.8 held-out accuracy) but not their side count (near
chance): colour is the task for a quick learning check (benchmarks/vision_learning.py).

`params` holds the geometry as drawn, in image pixels (y down): vertex coordinates, segment end points, the scale
(pixels per unit), so that the answer can be recomputed from the picture's geometry alone. Problem i draws from
its own `random.Random` seeded by (seed, i): the first n problems are the same for every larger n.

`motion`, the video task: MOTION_FRAMES frames of MOTION_SIZE pixels, a filled polygon (3 to 6 sides, a
random colour and rotation) that moves a fixed number of pixels per frame to the left or to the right; "Which way
does the shape move? Choices: A. left, B. right", answer A or B. Every frame looks alike, so the answer needs two
frames; the path's centre is drawn from one range for both directions. The row's video is its frame list (PNG
bytes), recorded at one frame per `MOTION_FPS`-th of a second.

`many_images`, the long-context task (docs/long_context.md): `images` images of MANY_IMAGES_SIZE pixels in one
prompt, "Image 1: <image>\nImage 2: <image>\n... Which image has a red background? Answer with its number.", answer
the number (1-based). Every image but one has a white background with a grey polygon; the one has a red background
(the red covers most of its 1024 vision tokens, the property background_colour showed a tiny model learns). The
prompt's length is set by `images` and the processor's pixel range: with Qwen3-VL-2B's processor at
max_pixels = 1024 * 1024 each image is 1024 vision tokens + 2 (vision start/end) + about 11 label tokens, so 15, 31 and
62 images make prompts of 15.6K, 32.2K and 64.3K tokens (`many_images_count` picks the count for a length).
"""

from __future__ import annotations

import io
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

KINDS = ("triangle_angle", "right_triangle", "parallel_lines", "circle")
MOTION_FRAMES = 4
MOTION_SIZE = 64  # pixels, square frames (Qwen3-VL takes frames of at least 32 x 32)
MOTION_FPS = 2.0  # the clip's frame rate: Qwen3-VL's sampling rate (its processors' fps), so every frame is sampled
MOTION_PROBLEM = "<video>Which way does the shape move? Choices: A. left, B. right"
MOTION_ANSWERS = {"left": "A", "right": "B"}
SIDES = (3, 4, 5, 6)  # the choices of the polygon_sides task
COLOURS = {
    "A": ("red", (214, 39, 40)),
    "B": ("green", (44, 160, 44)),
    "C": ("blue", (31, 119, 180)),
    "D": ("black", (0, 0, 0)),
}
TASKS = {  # task -> the kinds it cycles through
    "geometry": KINDS,
    "polygon_colour": ("polygon_colour",),
    "polygon_sides": ("polygon_sides",),
    "background_colour": ("background_colour",),
    "motion": ("motion",),  # the video task: generate_motion_problem, not generate_problem
    "many_images": ("many_images",),  # the long multi-image task: generate_many_images_problem
}
POLYGON_SIDES_PROBLEM = "<image>How many sides does the polygon have? Choices: " + ", ".join(map(str, SIDES)) + "."
COLOUR_CHOICES = {k: name for k, (name, _) in COLOURS.items()}  # letter -> colour name: the colour tasks' choices
_COLOUR_CHOICES_TEXT = ", ".join(f"{k}. {name}" for k, name in COLOUR_CHOICES.items())
POLYGON_COLOUR_PROBLEM = f"<image>What colour is the polygon? Choices: {_COLOUR_CHOICES_TEXT}."
BACKGROUND_COLOUR_PROBLEM = f"<image>What colour is the background? Choices: {_COLOUR_CHOICES_TEXT}."
IMAGE_SIZE = 256  # pixels, square
MANY_IMAGES_SIZE = 1024  # pixels, square: 1024 vision tokens each at Qwen3-VL's patch 16, merge 2 (max_pixels >= 2**20)
MANY_IMAGES_COLOUR = (214, 39, 40)  # the one red background of a many_images problem
_MARGIN = 36
_LINE = 2
_FONT_SIZE = 15
_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41), (12, 35, 37))

Point = tuple[float, float]


@dataclass(frozen=True)
class SynthProblem:
    kind: str  # one of KINDS
    problem: str  # "<image>Find x." style text, one <image>
    answer: str  # exact: an integer, or rounded to the tenth when the problem says so
    params: dict[str, Any]  # the drawn geometry (pixels, y down) and the labelled values
    image: Image.Image = field(repr=False)  # RGB, IMAGE_SIZE x IMAGE_SIZE


@dataclass(frozen=True)
class SynthVideoProblem:
    """One generated motion problem: a short clip of a polygon moving left or right (`generate_motion_problem`),
    the question, and its answer letter; `synth_records` turns it into a row with one video."""

    kind: str  # "motion"
    problem: str  # MOTION_PROBLEM, one <video>
    answer: str  # "A" (left) or "B" (right)
    params: dict[str, Any]  # direction, step (pixels per frame, signed), the shape and its centre in every frame
    frames: list[Image.Image] = field(repr=False)  # RGB, MOTION_SIZE x MOTION_SIZE each


@dataclass(frozen=True)
class SynthMultiImageProblem:
    """One generated many_images problem (`generate_many_images_problem`): numbered images, one of them red."""

    kind: str  # "many_images"
    problem: str  # "Image 1: <image>\n...Which image has a red background? Answer with its number."
    answer: str  # the red image's number, 1-based
    params: dict[str, Any]  # images, red (the answer as an int), and each image's background and polygon fill
    images: list[Image.Image] = field(repr=False)  # RGB, MANY_IMAGES_SIZE x MANY_IMAGES_SIZE each


def generate_problems(n: int, seed: int = 0, task: str = "geometry") -> list[SynthProblem]:
    """`n` problems of the image task `task`; the same (n, seed, task) always gives the same problems and pixels.

    Raises:
        ValueError: n < 0, or a task not in TASKS, or `motion` (generate_motion_problem makes those).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, found {n}")
    return [generate_problem(i, seed, task) for i in range(n)]


def generate_problem(i: int, seed: int = 0, task: str = "geometry") -> SynthProblem:
    """Problem number `i` of the stream (`seed`, `task`): kind TASKS[task][i % len(TASKS[task])].

    Raises:
        ValueError: a task not in TASKS, or `motion` (a video task: generate_motion_problem makes its clips).
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "motion":
        raise ValueError(
            "task 'motion' makes videos, not SynthProblems: use generate_motion_problem(i, seed) (or "
            "synth_records(n, seed, task='motion'))"
        )
    if task == "many_images":
        raise ValueError(
            "task 'many_images' makes several images per problem, not SynthProblems: use "
            "generate_many_images_problem(i, seed, images) (or synth_records(n, seed, task='many_images', images=N))"
        )
    # str seeds hash with sha512: stable across Python versions; the geometry stream keeps its original seeds
    rng = random.Random(f"miles-vl-synth:{seed}:{i}" if task == "geometry" else f"miles-vl-synth:{task}:{seed}:{i}")
    kinds = TASKS[task]
    kind = kinds[i % len(kinds)]
    if kind == "polygon_sides":
        return _polygon_sides(rng, SIDES[i % len(SIDES)])
    if kind == "polygon_colour":
        return _polygon_colour(rng, tuple(COLOURS)[i % len(COLOURS)])
    if kind == "background_colour":
        return _background_colour(rng, tuple(COLOURS)[i % len(COLOURS)])
    return _BUILDERS[kind](rng)


def many_images_problem_text(images: int) -> str:
    """The prompt of a many_images problem of `images` images (the same for every problem of that size)."""
    listing = "".join(f"Image {k}: <image>\n" for k in range(1, images + 1))
    return listing + "Which image has a red background? Answer with its number."


def many_images_count(tokens: int, tokens_per_image: int = 1024, reserve: int = 512) -> int:
    """The image count of a many_images prompt of about `tokens` tokens: images of `tokens_per_image` vision tokens
    (plus 2 vision start/end and about 11 label tokens each: 14 counted) leaving `reserve` tokens for the question,
    the chat template and the response.

    Raises:
        ValueError: fewer than 2 images fit.
    """
    count = (tokens - reserve) // (tokens_per_image + 14)
    if count < 2:
        raise ValueError(
            f"a many_images prompt of {tokens} tokens holds {count} images of {tokens_per_image} tokens (needs >= 2); "
            "give more tokens or smaller images"
        )
    return count


def generate_many_images_problem(i: int, seed: int = 0, images: int = 8) -> SynthMultiImageProblem:
    """Problem number `i` of the many_images stream (`seed`, `images`): `images` images, number i % images + 1 red
    (every answer equally often), the others white, each with a polygon of random sides, size and grey fill.

    Raises:
        ValueError: images < 2.
    """
    if images < 2:
        raise ValueError(f"a many_images problem needs at least 2 images, found {images}; set data.synthetic_images")
    rng = random.Random(f"miles-vl-synth:many_images:{seed}:{images}:{i}")
    red = i % images + 1
    pictures, drawn = [], []
    scale = MANY_IMAGES_SIZE / IMAGE_SIZE
    for k in range(1, images + 1):
        background = MANY_IMAGES_COLOUR if k == red else (255, 255, 255)
        grey = rng.randint(60, 200)
        small, params = _polygon(rng, rng.choice(SIDES), (grey, grey, grey), background=background)
        # drawn at IMAGE_SIZE and scaled up: the same pictures as the polygon tasks, at 1024 vision tokens
        pictures.append(small.resize((MANY_IMAGES_SIZE, MANY_IMAGES_SIZE), Image.NEAREST))
        drawn.append({"background": list(background), "fill": params["fill"], "sides": params["sides"]})
    params = {"images": images, "red": red, "size": MANY_IMAGES_SIZE, "scale": scale, "drawn": drawn}
    return SynthMultiImageProblem("many_images", many_images_problem_text(images), str(red), params, pictures)


def generate_motion_problem(i: int, seed: int = 0) -> SynthVideoProblem:
    """Clip number `i` of the stream `seed`: a polygon moving left or right over MOTION_FRAMES frames."""
    rng = random.Random(f"miles-vl-synth-motion:{seed}:{i}")
    direction = rng.choice(("left", "right"))
    sides, radius, step = rng.randint(3, 6), rng.randint(7, 10), rng.randint(5, 7)
    rotation = rng.uniform(0, 2 * math.pi)
    colour = tuple(rng.randint(0, 160) for _ in range(3))  # dark enough to stand out from the white background
    travel = step * (MOTION_FRAMES - 1)
    # The path's centre: the same range for both directions, and every frame keeps the whole shape inside.
    cx = rng.uniform(radius + 2 + travel / 2, MOTION_SIZE - radius - 2 - travel / 2)
    cy = rng.uniform(radius + 2, MOTION_SIZE - radius - 2)
    signed = step if direction == "right" else -step
    xs = [cx + signed * (f - (MOTION_FRAMES - 1) / 2) for f in range(MOTION_FRAMES)]
    frames = []
    for x in xs:
        img = Image.new("RGB", (MOTION_SIZE, MOTION_SIZE), "white")
        corners = [
            (
                x + radius * math.cos(rotation + 2 * math.pi * k / sides),
                cy + radius * math.sin(rotation + 2 * math.pi * k / sides),
            )
            for k in range(sides)
        ]
        ImageDraw.Draw(img).polygon(corners, fill=colour)
        frames.append(img)
    params = {
        "direction": direction,
        "step": signed,
        "sides": sides,
        "radius": radius,
        "centres": [[x, cy] for x in xs],
    }
    return SynthVideoProblem("motion", MOTION_PROBLEM, MOTION_ANSWERS[direction], params, frames)


def synth_records(n: int, seed: int = 0, task: str = "geometry", images: int = 8) -> list[dict[str, Any]]:
    """`n` problems as geometry3k-layout records: images [{bytes, path}], problem, answer, plus kind and params (JSON);
    with `task="motion"` the images are empty and `videos` holds one video, `{"frames": [{bytes, path}, ...], "fps":
    MOTION_FPS}`; with `task="many_images"` each record has `images` images (`generate_many_images_problem`).

    Raises:
        ValueError: n < 0, a task not in TASKS, or (many_images) images < 2.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "many_images":
        if n < 0:
            raise ValueError(f"n must be >= 0, found {n}")
        return [_many_images_record(generate_many_images_problem(i, seed, images), seed, i) for i in range(n)]
    if task == "motion":
        if n < 0:
            raise ValueError(f"n must be >= 0, found {n}")
        return [_motion_record(generate_motion_problem(i, seed), seed, i) for i in range(n)]
    return [
        {
            "images": [_png_ref(p.image, f"synth_{seed}_{i:06d}.png")],
            "problem": p.problem,
            "answer": p.answer,
            "kind": p.kind,
            "params": json.dumps(p.params, sort_keys=True),
        }
        for i, p in enumerate(generate_problems(n, seed, task))
    ]


def write_synth_parquet(path: str | Path, n: int, seed: int = 0, task: str = "geometry", images: int = 8) -> Path:
    """Write `synth_records(n, seed, task, images)` to a parquet file (the hiyouga/geometry3k schema plus kind and
    params, and for `task="motion"` a `videos` column: list<struct<frames: list<struct<bytes, path>>, fps>>).

    Returns:
        The path written (parent folders are created).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    fields = [
        ("images", pa.list_(image)),
        ("problem", pa.string()),
        ("answer", pa.string()),
        ("kind", pa.string()),
        ("params", pa.string()),
    ]
    if task == "motion":
        fields.append(("videos", pa.list_(pa.struct([("frames", pa.list_(image)), ("fps", pa.float64())]))))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(synth_records(n, seed, task, images), schema=pa.schema(fields)), path)
    return path


def _png_ref(image: Image.Image, path: str) -> dict[str, Any]:
    """An image as a geometry3k-layout entry: its PNG bytes and a file name."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": path}


def _many_images_record(p: SynthMultiImageProblem, seed: int, i: int) -> dict[str, Any]:
    return {
        "images": [_png_ref(image, f"synth_many_{seed}_{i:06d}_{k}.png") for k, image in enumerate(p.images)],
        "problem": p.problem,
        "answer": p.answer,
        "kind": p.kind,
        "params": json.dumps(p.params, sort_keys=True),
    }


def _motion_record(p: SynthVideoProblem, seed: int, i: int) -> dict[str, Any]:
    frames = [_png_ref(frame, f"synth_motion_{seed}_{i:06d}_{f}.png") for f, frame in enumerate(p.frames)]
    return {
        "images": [],
        "problem": p.problem,
        "answer": p.answer,
        "kind": p.kind,
        "params": json.dumps(p.params, sort_keys=True),
        "videos": [{"frames": frames, "fps": MOTION_FPS}],
    }


# ---------------------------------------------------------------------------------------------------------------------
# the four kinds


def _triangle_angle(rng: random.Random) -> SynthProblem:
    while True:
        a, b = rng.randint(25, 85), rng.randint(25, 85)
        if a + b <= 155:
            break
    angles = {"A": a, "B": b, "C": 180 - a - b}
    unknown = rng.choice("ABC")
    # A at the origin, B at (1, 0); C from the angles at A and B (law of sines), then scaled to the canvas.
    t = math.sin(math.radians(b)) / math.sin(math.radians(a + b))
    pts, _ = _fit(
        {"A": (0.0, 0.0), "B": (1.0, 0.0), "C": (t * math.cos(math.radians(a)), t * math.sin(math.radians(a)))}
    )
    img, draw, font = _canvas()
    draw.polygon([pts["A"], pts["B"], pts["C"]], outline="black", width=_LINE)
    centroid = _mean(list(pts.values()))
    for name, p in pts.items():
        draw.text(_toward(p, centroid, -16), name, fill="black", font=font, anchor="mm")
        others = [q for k, q in pts.items() if k != name]
        u, v = _unit(p, others[0]), _unit(p, others[1])
        bisector = _unit((0.0, 0.0), (u[0] + v[0], u[1] + v[1]))
        reach = min(max(16 / math.sin(math.radians(angles[name]) / 2), 26.0), 64.0)  # clear of both sides
        label = "x°" if name == unknown else f"{angles[name]}°"
        draw.text((p[0] + reach * bisector[0], p[1] + reach * bisector[1]), label, fill="black", font=font, anchor="mm")
    params = {"vertices": _as_lists(pts), "angles": angles, "unknown": unknown}
    return SynthProblem("triangle_angle", "<image>Find x.", str(angles[unknown]), params, img)


def _right_triangle(rng: random.Random) -> SynthProblem:
    unknown = rng.choice(("AB", "CA", "CB"))  # AB is the hypotenuse; CA = a and CB = b are the legs
    if rng.random() < 0.6:
        k = rng.randint(1, 3)
        a, b, _ = (k * s for s in rng.choice(_TRIPLES))
        if rng.random() < 0.5:
            a, b = b, a
    elif unknown == "AB":
        a, b = rng.randint(2, 15), rng.randint(2, 15)
    else:  # the given sides are a leg and the hypotenuse, both integers; the other leg follows
        leg = rng.randint(2, 12)
        hyp = rng.randint(leg + 1, leg + 10)
        other = math.sqrt(hyp * hyp - leg * leg)
        a, b = (other, leg) if unknown == "CA" else (leg, other)
    sides = {"CA": float(a), "CB": float(b), "AB": math.hypot(a, b)}
    exact = abs(sides[unknown] - round(sides[unknown])) < 1e-9
    answer = str(round(sides[unknown])) if exact else f"{sides[unknown]:.1f}"
    # Right angle at C (origin), A along x, B along y.
    pts, scale = _fit({"C": (0.0, 0.0), "A": (float(a), 0.0), "B": (0.0, float(b))})  # scale: pixels per unit
    img, draw, font = _canvas()
    draw.polygon([pts["A"], pts["B"], pts["C"]], outline="black", width=_LINE)
    ux, uy = _unit(pts["C"], pts["A"])
    vx, vy = _unit(pts["C"], pts["B"])
    cx, cy = pts["C"]
    q = 12  # right-angle marker
    draw.line(
        [(cx + q * ux, cy + q * uy), (cx + q * (ux + vx), cy + q * (uy + vy)), (cx + q * vx, cy + q * vy)],
        fill="black",
        width=1,
    )
    centroid = _mean(list(pts.values()))
    for name, p in pts.items():
        draw.text(_toward(p, centroid, -16), name, fill="black", font=font, anchor="mm")
    for side, value in sides.items():
        mid = _mean([pts[side[0]], pts[side[1]]])
        label = "x" if side == unknown else str(round(value))  # the given sides are integers
        draw.text(_toward(mid, centroid, -18), label, fill="black", font=font, anchor="mm")
    question = "<image>Find x." if exact else "<image>Find x. Round to the nearest tenth."
    params = {
        "vertices": _as_lists(pts),
        "scale": scale,
        "sides": {k: round(v) for k, v in sides.items() if k != unknown},  # the labelled (integer) sides
        "unknown": unknown,
        "rounded": not exact,
    }
    return SynthProblem("right_triangle", question, answer, params, img)


def _parallel_lines(rng: random.Random) -> SynthProblem:
    theta = rng.choice([d for d in range(40, 141) if not 80 <= d <= 100])
    s = IMAGE_SIZE
    top, bottom, mid = 80.0, 176.0, s / 2
    d = (math.cos(math.radians(theta)), -math.sin(math.radians(theta)))  # transversal direction, "up" (y down)
    reach = (mid - top) / math.sin(math.radians(theta))
    i_top = (mid + d[0] * reach, top)
    i_bottom = (mid - d[0] * reach, bottom)
    lines = {"m": [(16.0, top), (s - 16.0, top)], "n": [(16.0, bottom), (s - 16.0, bottom)]}
    ext = 52.0
    transversal = [(i_top[0] + d[0] * ext, i_top[1] + d[1] * ext), (i_bottom[0] - d[0] * ext, i_bottom[1] - d[1] * ext)]
    # The eight angles: (intersection, horizontal ray, transversal ray).
    rays_h = {"right": (1.0, 0.0), "left": (-1.0, 0.0)}
    rays_t = {"up": d, "down": (-d[0], -d[1])}
    positions = [(v, h, t) for v in ("top", "bottom") for h in rays_h for t in rays_t]
    known_pos, unknown_pos = rng.sample(positions, 2)
    vertex = {"top": i_top, "bottom": i_bottom}

    def value(pos: tuple[str, str, str]) -> int:  # right/up and left/down are theta, the others its supplement
        return theta if (pos[1] == "right") == (pos[2] == "up") else 180 - theta

    img, draw, font = _canvas()
    for name, (p0, p1) in lines.items():
        draw.line([p0, p1], fill="black", width=_LINE)
        draw.text((p1[0] - 4, p1[1] - 12), name, fill="black", font=font, anchor="mm")
        ax = p0[0] + 30  # the parallel marks: one arrow head on each line
        draw.line([(ax - 6, p0[1] - 5), (ax, p0[1]), (ax - 6, p0[1] + 5)], fill="black", width=_LINE)
    draw.line(transversal, fill="black", width=_LINE)
    angles = []
    for pos, label in ((known_pos, f"{value(known_pos)}°"), (unknown_pos, "x°")):
        v, h, t = pos
        bis = _unit((0.0, 0.0), (rays_h[h][0] + rays_t[t][0], rays_h[h][1] + rays_t[t][1]))
        at = (vertex[v][0] + 28 * bis[0], vertex[v][1] + 28 * bis[1])
        draw.text(at, label, fill="black", font=font, anchor="mm")
        angles.append({"vertex": list(vertex[v]), "rays": [list(rays_h[h]), list(rays_t[t])], "label": label})
    params = {
        "lines": {k: [list(p) for p in seg] for k, seg in lines.items()},
        "transversal": [list(p) for p in transversal],
        "angles": angles,  # [known, unknown]; each angle lies between its two rays from its vertex
    }
    problem = "<image>Lines m and n are parallel. Find x."
    return SynthProblem("parallel_lines", problem, str(value(unknown_pos)), params, img)


def _circle(rng: random.Random) -> SynthProblem:
    r = rng.randint(3, 20)
    kind = rng.choice(("radius", "diameter"))
    ask = rng.choice(("circumference", "area"))
    center = (IMAGE_SIZE / 2, IMAGE_SIZE / 2 + 6)
    radius_px = 84.0
    phi = math.radians(rng.choice((-30, -20, 20, 30, 150, 160, 200, 210)))
    edge = (center[0] + radius_px * math.cos(phi), center[1] - radius_px * math.sin(phi))
    segment = [center, edge] if kind == "radius" else [(2 * center[0] - edge[0], 2 * center[1] - edge[1]), edge]
    label = r if kind == "radius" else 2 * r
    img, draw, font = _canvas()
    cx, cy = center
    draw.ellipse([cx - radius_px, cy - radius_px, cx + radius_px, cy + radius_px], outline="black", width=_LINE)
    draw.line(segment, fill="black", width=_LINE)
    draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill="black")
    draw.text((cx - 4, cy + 14), "O", fill="black", font=font, anchor="mm")
    mid = _mean([center, edge])  # the label sits on the radius half (clear of "O" for a diameter too)
    ux, uy = _unit(center, edge)
    draw.text((mid[0] - 14 * uy, mid[1] + 14 * ux), str(label), fill="black", font=font, anchor="mm")
    value = 2 * math.pi * r if ask == "circumference" else math.pi * r * r
    params = {
        "center": list(center),
        "radius_px": radius_px,
        "scale": radius_px / r,
        "segment": [list(p) for p in segment],
        "segment_kind": kind,
        "label": label,
        "ask": ask,
    }
    problem = f"<image>Find the {ask} of \\odot O. Round to the nearest tenth."
    return SynthProblem("circle", problem, f"{value:.1f}", params, img)


# Fill colours of polygon_sides: any of them on white, so that colour says nothing about the answer.
_FILLS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (140, 86, 75), (0, 0, 0))


def _polygon_sides(rng: random.Random, sides: int) -> SynthProblem:
    img, params = _polygon(rng, sides, rng.choice(_FILLS))
    params["choices"] = list(SIDES)
    return SynthProblem("polygon_sides", POLYGON_SIDES_PROBLEM, str(sides), params, img)


def _polygon_colour(rng: random.Random, letter: str) -> SynthProblem:
    img, params = _polygon(rng, rng.choice(SIDES), COLOURS[letter][1])
    params["choices"] = dict(COLOUR_CHOICES)
    return SynthProblem("polygon_colour", POLYGON_COLOUR_PROBLEM, letter, params, img)


def _background_colour(rng: random.Random, letter: str) -> SynthProblem:
    img, params = _polygon(rng, rng.choice(SIDES), (255, 255, 255), background=COLOURS[letter][1])
    params["choices"] = dict(COLOUR_CHOICES)
    return SynthProblem("background_colour", BACKGROUND_COLOUR_PROBLEM, letter, params, img)


def _polygon(
    rng: random.Random, sides: int, fill: tuple[int, int, int], background: tuple[int, int, int] = (255, 255, 255)
) -> tuple[Image.Image, dict[str, Any]]:
    """A filled regular polygon on `background`: random circumradius, centre and a small tilt; its image and
    geometry."""
    radius = rng.uniform(72.0, 100.0)  # circumradius, pixels
    center = (IMAGE_SIZE / 2 + rng.uniform(-14.0, 14.0), IMAGE_SIZE / 2 + rng.uniform(-14.0, 14.0))
    tilt = rng.uniform(-12.0, 12.0)  # degrees; 0 puts one side flat at the bottom
    # Vertex k at angle -90° + 180°/n + k·360°/n (math convention, y up): the bottom side is horizontal at tilt 0.
    vertices = []
    for k in range(sides):
        a = math.radians(-90.0 + 180.0 / sides + 360.0 * k / sides + tilt)
        vertices.append((center[0] + radius * math.cos(a), center[1] - radius * math.sin(a)))  # y down
    img, draw, _ = _canvas(background)
    draw.polygon(vertices, fill=fill)
    params = {
        "sides": sides,
        "vertices": [[x, y] for x, y in vertices],
        "center": list(center),
        "radius_px": radius,
        "tilt_deg": tilt,
        "fill": list(fill),
        "background": list(background),
    }
    return img, params


_BUILDERS = {
    "triangle_angle": _triangle_angle,
    "right_triangle": _right_triangle,
    "parallel_lines": _parallel_lines,
    "circle": _circle,
}


# ---------------------------------------------------------------------------------------------------------------------
# drawing helpers


def _canvas(
    background: tuple[int, int, int] | str = "white",
) -> tuple[Image.Image, ImageDraw.ImageDraw, ImageFont.FreeTypeFont | ImageFont.ImageFont]:
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), background)
    return img, ImageDraw.Draw(img), ImageFont.load_default(size=_FONT_SIZE)


def _fit(points: dict[str, Point]) -> tuple[dict[str, Point], float]:
    """Scale math coordinates (y up) uniformly into the canvas (y down), centred, inside the margin."""
    xs, ys = [p[0] for p in points.values()], [p[1] for p in points.values()]
    span = max(max(xs) - min(xs), max(ys) - min(ys))
    scale = (IMAGE_SIZE - 2 * _MARGIN) / span
    ox = (IMAGE_SIZE - scale * (max(xs) - min(xs))) / 2
    oy = (IMAGE_SIZE - scale * (max(ys) - min(ys))) / 2
    return {
        k: (ox + scale * (x - min(xs)), IMAGE_SIZE - oy - scale * (y - min(ys))) for k, (x, y) in points.items()
    }, scale


def _toward(p: Point, target: Point, distance: float) -> Point:
    """`p` moved `distance` pixels toward `target` (away from it when negative)."""
    ux, uy = _unit(p, target)
    return (p[0] + distance * ux, p[1] + distance * uy)


def _unit(p: Point, q: Point) -> Point:
    dx, dy = q[0] - p[0], q[1] - p[1]
    n = math.hypot(dx, dy)
    return (dx / n, dy / n)


def _mean(points: list[Point]) -> Point:
    return (sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points))


def _as_lists(points: dict[str, Point]) -> dict[str, list[float]]:
    return {k: [float(x), float(y)] for k, (x, y) in points.items()}
