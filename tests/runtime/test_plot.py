"""runtime/plot.py: a Gantt chart per timeline, bars in the colour of their action kind, drawn
where the timeline puts them."""

from __future__ import annotations

import numpy as np
import pytest

from pipecompile.runtime import plot
from pipecompile.schedule.actions import Kind
from pipecompile.schedule.schedules import make_schedule
from pipecompile.schedule.simulate import StageCosts, simulate


def _share_of(image, colour):
    """Fraction of the image's pixels within a small distance of `colour` ("#rrggbb")."""
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return float((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.02).mean())


def _image(timelines, path, **options):
    import matplotlib.image

    assert plot.plot_timelines(timelines, str(path), **options) == str(path)
    return matplotlib.image.imread(str(path))


@pytest.mark.parametrize("backward", [1.0, 3.0])
def test_bar_areas_follow_the_action_times(tmp_path, backward):
    # 1F1B, every F 1 s and every B `backward` s: F's bars cover 1 / (1 + backward) of the bars
    timeline = simulate(make_schedule("1f1b", 2, 4), [StageCosts(1.0, backward)] * 2)
    image = _image({"1f1b": timeline}, tmp_path / "1f1b.png", title="p=2 m=4")
    f, b = (_share_of(image, plot._COLORS[k]) for k in (Kind.F, Kind.B))
    assert f > 0.01 and b > 0.01
    assert f / (f + b) == pytest.approx(1 / (1 + backward), abs=0.02)
    assert _share_of(image, plot._COLORS[Kind.I]) == _share_of(image, plot._COLORS[Kind.W]) == 0


def test_split_backward_is_drawn_as_i_and_w_in_their_own_colours(tmp_path):
    # zero-bubble: B = 2 s split into I = W = 1 s, as long as F: three equal areas, no B
    timeline = simulate(make_schedule("zb-h1", 2, 4), [StageCosts(1.0, 2.0)] * 2)
    image = _image({"zb-h1": timeline}, tmp_path / "zb.png")
    shares = [_share_of(image, plot._COLORS[k]) for k in (Kind.F, Kind.I, Kind.W)]
    assert min(shares) > 0.01
    assert max(shares) / min(shares) == pytest.approx(1.0, abs=0.03)
    assert _share_of(image, plot._COLORS[Kind.B]) == 0.0


def test_one_panel_per_timeline(tmp_path):
    timeline = simulate(make_schedule("gpipe", 3, 2), [StageCosts(1.0, 1.0)] * 3)
    one = _image({"a": timeline}, tmp_path / "one.png")
    two = _image({"a": timeline, "b": timeline}, tmp_path / "two.png")
    assert two.shape[0] > one.shape[0] and two.shape[1] == one.shape[1]  # taller, as wide
    # 1.0 + 0.6 inches per device row: 2.8 and 4.6 inches tall
    assert two.shape[0] / one.shape[0] == pytest.approx(4.6 / 2.8, rel=0.02)
    assert _share_of(two, plot._COLORS[Kind.F]) > 0.01
