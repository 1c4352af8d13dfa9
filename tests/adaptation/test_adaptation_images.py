"""Real-frame folders: bad inputs stop with messages naming the folder or the file."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from adaptation.images import RealFrames, RealFramesError, load_real_frames, read_rgb
from perception.core.calibration import Calibration, default_calibration_path


@pytest.fixture
def calib():
    return Calibration.load(default_calibration_path())


def _frame(calib, value=100):
    w, h = calib.image_size
    return np.full((h, w, 3), value, np.uint8)


def test_loads_frames_in_name_order_as_rgb(tmp_path, calib):
    a = _frame(calib)
    a[..., 0] = 200  # red in RGB
    cv2.imwrite(str(tmp_path / "b.png"), a[:, :, ::-1])
    cv2.imwrite(str(tmp_path / "a.jpg"), _frame(calib, 50))
    (tmp_path / "notes.txt").write_text("ignored")
    frames = load_real_frames(tmp_path, calib)
    assert len(frames) == 2
    assert frames[0].shape == (calib.height, calib.width, 3) and frames[0].dtype == np.uint8
    assert abs(int(frames[1][0, 0, 0]) - 200) <= 1 and int(frames[1][0, 0, 2]) == 100


def test_missing_folder(tmp_path, calib):
    with pytest.raises(RealFramesError, match="does not exist"):
        load_real_frames(tmp_path / "nope", calib)


def test_empty_folder_names_it(tmp_path, calib):
    with pytest.raises(RealFramesError, match=f"{tmp_path}.*holds no"):
        load_real_frames(tmp_path, calib)


def test_unreadable_file_is_named(tmp_path, calib):
    cv2.imwrite(str(tmp_path / "good.png"), _frame(calib))
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    with pytest.raises(RealFramesError, match=r"broken\.png.*not a readable"):
        load_real_frames(tmp_path, calib)


def test_wrong_size_is_named(tmp_path, calib):
    cv2.imwrite(str(tmp_path / "small.png"), np.zeros((240, 320, 3), np.uint8))
    with pytest.raises(RealFramesError, match=r"small\.png is 320x240 but the calibration's image_size is 640x480"):
        load_real_frames(tmp_path, calib)


def test_grey_rgba_and_16bit_are_converted(tmp_path):
    cv2.imwrite(str(tmp_path / "g.png"), np.full((4, 6), 7, np.uint8))
    cv2.imwrite(str(tmp_path / "a.png"), np.full((4, 6, 4), 9, np.uint8))
    cv2.imwrite(str(tmp_path / "w.png"), np.full((4, 6, 3), 256 * 11, np.uint16))
    for name, v in (("g", 7), ("a", 9), ("w", 11)):
        img = read_rgb(tmp_path / f"{name}.png")
        assert img.shape == (4, 6, 3) and img.dtype == np.uint8 and int(img[0, 0, 0]) == v


def test_real_frames_on_disk_are_the_loaded_frames_read_when_indexed(tmp_path, calib):
    """``RealFrames`` lists the folder as ``load_real_frames`` does and reads a frame only when
    it is indexed: a frame of the wrong size stops only the read that reaches it, by name."""
    for i in range(3):
        cv2.imwrite(str(tmp_path / f"{i}.png"), _frame(calib, 40 * (i + 1)))
    frames = RealFrames(tmp_path, calib)
    assert len(frames) == 3
    for lazy, loaded in zip(frames, load_real_frames(tmp_path, calib)):
        np.testing.assert_array_equal(lazy, loaded)
    cv2.imwrite(str(tmp_path / "3.png"), np.zeros((10, 10, 3), np.uint8))
    frames = RealFrames(tmp_path, calib)
    assert len(frames) == 4 and int(frames[2][0, 0, 0]) == 120
    with pytest.raises(RealFramesError, match="3.png is 10x10"):
        frames[3]
    (tmp_path / "empty").mkdir()
    with pytest.raises(RealFramesError, match="holds no"):
        RealFrames(tmp_path / "empty", calib)
