"""Contract: the generator is deterministic by seed, every answer equals the one recomputed here from the drawn
geometry alone (pixel coordinates and scale in `params`, not the generator's own numbers), and the image really
holds the diagram: dark pixels along every drawn segment and circle."""

import argparse
import inspect
import io
import json
import math
import typing

import numpy as np
import pyarrow.parquet as pq
import pytest

from miles_vl.config.schema import DataConfig
from miles_vl.data import (
    KINDS,
    TASKS,
    LoadOptions,
    generate_problems,
    load_prompt_records,
    synth_records,
    write_synth_parquet,
)
from miles_vl.data.cli import configure
from miles_vl.data.synth import generate_motion_problem, generate_problem

N = 40  # 10 of each kind


@pytest.fixture(scope="module")
def problems():
    return generate_problems(N, seed=123)


def png(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def angle_at(vertex, p, q):
    """Angle p-vertex-q in degrees, from coordinates."""
    a = (p[0] - vertex[0], p[1] - vertex[1])
    b = (q[0] - vertex[0], q[1] - vertex[1])
    return math.degrees(math.acos((a[0] * b[0] + a[1] * b[1]) / (math.hypot(*a) * math.hypot(*b))))


def dark_along(img, p, q, samples=7, radius=2, threshold=100):
    """Every sampled point of segment pq has a dark pixel within `radius`."""
    arr = np.asarray(img.convert("L"))
    for k in range(1, samples + 1):
        t = k / (samples + 1)
        x, y = round(p[0] + t * (q[0] - p[0])), round(p[1] + t * (q[1] - p[1]))
        patch = arr[max(y - radius, 0) : y + radius + 1, max(x - radius, 0) : x + radius + 1]
        if patch.min() >= threshold:
            return False
    return True


def test_deterministic_by_seed(problems):
    again = generate_problems(N, seed=123)
    assert [(p.problem, p.answer, p.params) for p in again] == [(p.problem, p.answer, p.params) for p in problems]
    assert all(png(a.image) == png(b.image) for a, b in zip(again, problems, strict=True))
    other = generate_problems(N, seed=124)
    assert [p.params for p in other] != [p.params for p in problems]
    assert [p.answer for p in generate_problems(8, seed=123)] == [p.answer for p in problems[:8]]  # prefix-stable
    assert [p.kind for p in problems[:4]] == list(KINDS)


def test_triangle_angles(problems):
    for p in (p for p in problems if p.kind == "triangle_angle"):
        v = p.params["vertices"]
        measured = {n: angle_at(v[n], *[v[m] for m in "ABC" if m != n]) for n in "ABC"}
        assert sum(measured.values()) == pytest.approx(180)
        for name, value in p.params["angles"].items():
            if name != p.params["unknown"]:
                assert round(measured[name]) == value  # the labels match the drawing
        assert p.answer == str(round(measured[p.params["unknown"]]))
        assert p.problem == "<image>Find x."
        for a, b in ("AB", "BC", "CA"):
            assert dark_along(p.image, v[a], v[b])


def test_right_triangles(problems):
    for p in (p for p in problems if p.kind == "right_triangle"):
        v, scale = p.params["vertices"], p.params["scale"]
        assert angle_at(v["C"], v["A"], v["B"]) == pytest.approx(90)
        length = {s: math.dist(v[s[0]], v[s[1]]) / scale for s in ("CA", "CB", "AB")}
        for side, value in p.params["sides"].items():
            assert length[side] == pytest.approx(value)
        x = length[p.params["unknown"]]
        if p.params["rounded"]:
            assert p.answer == f"{x:.1f}" and "Round to the nearest tenth" in p.problem
        else:
            assert p.answer == str(round(x)) and x == pytest.approx(round(x))
        for a, b in ("AB", "BC", "CA"):
            assert dark_along(p.image, v[a], v[b])


def test_parallel_lines(problems):
    for p in (p for p in problems if p.kind == "parallel_lines"):
        (m0, m1), (n0, n1) = p.params["lines"]["m"], p.params["lines"]["n"]
        t0, t1 = p.params["transversal"]
        dm = (m1[0] - m0[0], m1[1] - m0[1])
        dn = (n1[0] - n0[0], n1[1] - n0[1])
        dt = (t1[0] - t0[0], t1[1] - t0[1])
        assert dm[0] * dn[1] - dm[1] * dn[0] == pytest.approx(0)  # m and n are parallel
        values = []
        for angle in p.params["angles"]:
            vx, vy = angle["vertex"]
            on_m_or_n = any(
                (vx - a[0]) * d[1] - (vy - a[1]) * d[0] == pytest.approx(0, abs=1e-6) for a, d in ((m0, dm), (n0, dn))
            )
            on_t = (vx - t0[0]) * dt[1] - (vy - t0[1]) * dt[0] == pytest.approx(0, abs=1e-6)
            assert on_m_or_n and on_t  # the angle sits at an intersection of the drawn lines
            (r1, r2) = angle["rays"]
            assert r1[0] * dm[1] - r1[1] * dm[0] == pytest.approx(0)  # one ray along the parallel lines
            assert r2[0] * dt[1] - r2[1] * dt[0] == pytest.approx(0, abs=1e-9)  # the other along the transversal
            values.append(angle_at((0, 0), r1, r2))
        known, unknown = p.params["angles"]
        assert known["label"] == f"{round(values[0])}°" and unknown["label"] == "x°"
        assert p.answer == str(round(values[1]))
        for seg in ((m0, m1), (n0, n1), (t0, t1)):
            assert dark_along(p.image, *seg)


def test_circles(problems):
    for p in (p for p in problems if p.kind == "circle"):
        c, rpx, scale = p.params["center"], p.params["radius_px"], p.params["scale"]
        a, b = p.params["segment"]
        if p.params["segment_kind"] == "radius":
            assert a == pytest.approx(c) and math.dist(c, b) == pytest.approx(rpx)
        else:
            assert math.dist(c, a) == pytest.approx(rpx) and math.dist(c, b) == pytest.approx(rpx)
            assert [(a[0] + b[0]) / 2, (a[1] + b[1]) / 2] == pytest.approx(c)
        r = rpx / scale
        label = p.params["label"]
        assert label == pytest.approx(r if p.params["segment_kind"] == "radius" else 2 * r)
        value = 2 * math.pi * r if p.params["ask"] == "circumference" else math.pi * r * r
        assert p.answer == f"{value:.1f}" and p.params["ask"] in p.problem
        rim = [(c[0] + rpx * math.cos(t), c[1] + rpx * math.sin(t)) for t in np.linspace(0, 2 * math.pi, 9)]
        for q0, q1 in zip(rim, rim[1:], strict=False):
            assert dark_along(p.image, q0, q0, samples=1) and dark_along(p.image, q1, q1, samples=1)
        assert dark_along(p.image, a, b)


def test_images_are_not_blank(problems):
    for p in problems:
        arr = np.asarray(p.image.convert("L"))
        assert p.image.size == (256, 256)
        assert 0.01 < (arr < 128).mean() < 0.5


def test_records_and_parquet_load_as_geometry3k(tmp_path, encoder):
    records = synth_records(8, seed=2)
    assert set(records[0]) == {"images", "problem", "answer", "kind", "params"}
    assert set(records[0]["images"][0]) == {"bytes", "path"}
    assert json.loads(records[0]["params"]) == generate_problems(1, seed=2)[0].params
    path = write_synth_parquet(tmp_path / "sub" / "s.parquet", 8, seed=2)
    table = pq.read_table(path)
    assert table.num_rows == 8 and table.column_names == ["images", "problem", "answer", "kind", "params"]
    rows, report = load_prompt_records(table.to_pylist(), encoder, LoadOptions(max_prompt_len=512), source=str(path))
    assert report.layout == "geometry3k" and report.n_kept == 8
    assert rows[0].metadata["kind"] == "triangle_angle" and rows[0].label == records[0]["answer"]


# ---------------------------------------------------------------------------------------------------------------------
# the motion video task


def shape_x(frame):
    """Column centroid of the non-white pixels: where the shape is, found from the pixels alone."""
    arr = np.asarray(frame.convert("L"))
    cols = np.nonzero(arr < 250)[1]
    assert cols.size > 20, "the frame holds no shape"
    return float(cols.mean())


def test_motion_clips_are_deterministic_and_answerable_from_the_frames():
    """The independent rule: the shape's centroid moves right across the frames -> B, left -> A. One frame alone
    does not tell: the centroids of single frames span the same range for both answers."""
    clips = [generate_motion_problem(i, seed=4) for i in range(24)]
    again = generate_motion_problem(5, seed=4)
    assert [np.asarray(f).tobytes() for f in again.frames] == [np.asarray(f).tobytes() for f in clips[5].frames]
    assert [np.asarray(f).tobytes() for f in generate_motion_problem(5, seed=5).frames] != [
        np.asarray(f).tobytes() for f in again.frames
    ]
    firsts = {"A": [], "B": []}
    for clip in clips:
        assert clip.problem == "<video>Which way does the shape move? Choices: A. left, B. right"
        assert len(clip.frames) == 4 and {f.size for f in clip.frames} == {(64, 64)}
        xs = [shape_x(f) for f in clip.frames]
        steps = np.diff(xs)
        assert np.all(np.abs(steps) > 3) and (np.all(steps > 0) or np.all(steps < 0))  # steady, one way
        assert clip.answer == ("B" if xs[-1] > xs[0] else "A")
        firsts[clip.answer].append(xs[0])
    assert len(firsts["A"]) >= 6 and len(firsts["B"]) >= 6  # both answers occur
    # single frames overlap: some left-moving clip starts left of some right-moving clip's start, and vice versa
    assert min(firsts["A"]) < max(firsts["B"]) and min(firsts["B"]) < max(firsts["A"])


def test_motion_records_and_parquet_load_as_videos(tmp_path):
    from miles_vl.data import PromptEncoder, VideoSettings, load_processor

    processor = load_processor("offline", 32 * 32, 64 * 64, VideoSettings(min_pixels=32 * 32, max_pixels=4 * 64 * 64))
    encoder = PromptEncoder(processor)
    records = synth_records(3, seed=1, task="motion")
    assert records[0]["images"] == [] and len(records[0]["videos"][0]["frames"]) == 4
    path = write_synth_parquet(tmp_path / "m.parquet", 3, seed=1, task="motion")
    table = pq.read_table(path)
    assert table.column_names == ["images", "problem", "answer", "kind", "params", "videos"]
    rows, report = load_prompt_records(table.to_pylist(), encoder, LoadOptions(max_prompt_len=512), source=str(path))
    assert report.n_kept == 3 and [r.label for r in rows] == [r["answer"] for r in records]
    sample = encoder.encode(rows[0])
    assert sample.video_grid_thw.tolist() == [[2, 4, 4]] and sample.image_grid_thw is None
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'"):
        synth_records(1, task="nope")


# ---------------------------------------------------------------------------------------------------------------------
# the task names


def test_one_task_vocabulary():
    """`synth.TASKS` is the list of tasks; `data.synthetic_task` (a Literal, as config imports no data module) names
    the same tasks in the same order with the same default, and `miles-vl data synth --task` takes exactly those
    (its choices are the schema's); every task generates rows of its own kinds."""
    field = DataConfig.model_fields["synthetic_task"]
    assert typing.get_args(field.annotation) == tuple(TASKS)
    task_default = inspect.signature(synth_records).parameters["task"].default
    assert field.default == "geometry" == task_default == generate_problem.__defaults__[-1]
    parser = argparse.ArgumentParser()
    configure(parser)
    assert parser.parse_args(["synth", "out.parquet"]).task == "geometry"
    for name in TASKS:
        assert parser.parse_args(["synth", "out.parquet", "--task", name]).task == name
    with pytest.raises(SystemExit):  # the old name of geometry (issue 18's branch) is no task
        parser.parse_args(["synth", "out.parquet", "--task", "geo3k"])
    for name in TASKS:
        assert synth_records(1, seed=0, task=name)[0]["kind"] in TASKS[name]
    with pytest.raises(ValueError, match="generate_motion_problem"):
        generate_problems(1, task="motion")
    with pytest.raises(ValueError, match="generate_many_images_problem"):
        generate_problems(1, task="many_images")
