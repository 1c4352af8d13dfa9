"""Decoding frames from bytes: formats, conversions, clear refusals."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from perception.core.imageio import ImageDecodeError, ImageSizeError, decode_image, encode_image, peek_size


def _png(arr: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", arr)
    assert ok
    return buf.tobytes()


def test_round_trip_rgb(frame):
    out = decode_image(encode_image(frame, "png"))
    np.testing.assert_array_equal(out, frame)  # RGB order kept through OpenCV's BGR
    assert peek_size(encode_image(frame, "jpeg")) == ("jpeg", (640, 480))


def test_conversions():
    gray = np.arange(48, dtype=np.uint8).reshape(6, 8)
    out = decode_image(_png(gray))
    assert out.shape == (6, 8, 3) and np.all(out[..., 0] == gray)
    g16 = (gray.astype(np.uint16) * 257)
    out = decode_image(_png(g16))
    assert out.dtype == np.uint8 and np.all(out[..., 1] == gray)
    bgra = np.zeros((6, 8, 4), np.uint8)
    bgra[..., 2] = 200  # red in BGRA
    bgra[..., 3] = 17
    out = decode_image(_png(bgra))
    assert out.shape == (6, 8, 3) and np.all(out[..., 0] == 200) and np.all(out[..., 2] == 0)
    bgr16 = np.zeros((6, 8, 3), np.uint16)
    bgr16[..., 0] = 65535  # blue
    out = decode_image(_png(bgr16))
    assert np.all(out[..., 2] == 255) and np.all(out[..., 0] == 0)


def test_refusals(png_bytes, jpeg_bytes):
    with pytest.raises(ImageDecodeError, match="empty"):
        decode_image(b"")
    with pytest.raises(ImageDecodeError, match="signature"):
        decode_image(b"GIF89a....")
    with pytest.raises(ImageDecodeError, match="truncated"):
        decode_image(png_bytes[: len(png_bytes) // 2])
    with pytest.raises(ImageDecodeError, match="truncated"):
        decode_image(jpeg_bytes[: len(jpeg_bytes) // 2])
    with pytest.raises(ImageDecodeError):
        decode_image(png_bytes[:20])
    with pytest.raises(ImageSizeError, match="640x480 but the calibration's image_size is 320x240"):
        decode_image(png_bytes, expected_size=(320, 240))
    bomb = bytearray(png_bytes)
    bomb[16:24] = (100000).to_bytes(4, "big") * 2
    with pytest.raises(ImageDecodeError, match="impossible size"):
        decode_image(bytes(bomb))


def test_atomic_files_respect_the_umask(tmp_path):
    """issue 12: mkstemp's 0600 made shared datasets unreadable; files get 0666 less the umask."""
    import os
    import stat

    from perception.core.atomic import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600
