"""Decode and encode camera frames (PNG / JPEG bytes <-> RGB ``uint8``).

:func:`decode_image` is the one place where bytes from the outside become an image:
it checks the signature and the declared size *before* decoding (so a huge or wrong-size
frame costs nothing and cannot exhaust memory), refuses truncated files, and converts
grayscale, RGBA and 16-bit frames to 8-bit RGB (contract section 6). A JPEG's scans are
counted from its markers before decoding: each scan of a progressive JPEG is one more pass
over the whole image, so a legal 640x480 file with hundreds of thousands of them decodes
for half a minute; more than ``max_jpeg_scans`` is refused instead.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import cv2
import numpy as np

from perception.core.atomic import atomic_write_bytes
from perception.core.preprocess import ensure_rgb8

__all__ = [
    "ImageDecodeError",
    "ImageSizeError",
    "sniff_format",
    "peek_size",
    "jpeg_scan_count",
    "decode_image",
    "encode_image",
    "read_image",
    "write_image",
]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SIGNATURE = b"\xff\xd8\xff"
#: Refuse images with more pixels than this before decoding (decompression bombs).
MAX_PIXELS = 64_000_000
#: Refuse JPEGs with more scans than this before decoding (a camera writes 1, a
#: progressive encoder about 10; every scan costs a pass over the whole image).
MAX_JPEG_SCANS = 32
#: Refuse JPEGs with more marker segments than this (a camera writes a few dozen), so the
#: count itself stays cheap.
MAX_JPEG_SEGMENTS = 1024
# The end of a scan's entropy-coded data: 0xFF followed by neither a stuffed 0x00, a
# restart marker (D0-D7) nor a fill byte.
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


class ImageDecodeError(ValueError):
    """Bytes that are not a complete PNG or JPEG image."""


class ImageSizeError(ImageDecodeError):
    """A valid image whose size is not the one expected (another camera)."""


def sniff_format(data: bytes) -> str | None:
    """``"png"``, ``"jpeg"`` or ``None`` from the file signature."""
    if data[:8] == PNG_SIGNATURE:
        return "png"
    if data[:3] == JPEG_SIGNATURE:
        return "jpeg"
    return None


def _png_size(data: bytes) -> tuple[int, int]:
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise ImageDecodeError("PNG header is truncated or lacks IHDR")
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_segments(data: bytes):
    """Yield ``(marker, offset, length)`` for each marker after SOI, without decoding.

    ``length`` is ``None`` for a standalone marker. Fill bytes are skipped, and so is a
    scan's entropy-coded data after its SOS segment. Ends at the data's end (a segment
    header cut off there is not yielded).

    Raises:
        ImageDecodeError: a corrupt marker structure.
    """
    i, n = 2, len(data)
    while i + 2 <= n:
        if data[i] != 0xFF:
            raise ImageDecodeError("JPEG marker structure is corrupt")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD9:  # standalone markers
            yield marker, i, None
            i += 2
            continue
        if i + 4 > n:
            return
        seg_len = struct.unpack(">H", data[i + 2 : i + 4])[0]
        if seg_len < 2:
            raise ImageDecodeError("JPEG segment length is corrupt")
        yield marker, i, seg_len
        i += 2 + seg_len
        if marker == 0xDA:
            m = _NEXT_MARKER.search(data, i)
            if m is None:
                return
            i = m.start()


def _jpeg_size(data: bytes) -> tuple[int, int]:
    for marker, i, _ in _jpeg_segments(data):
        if marker in _SOF_MARKERS:
            if i + 9 > len(data):
                break
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return int(w), int(h)
        if marker == 0xDA:  # start of scan before any frame header
            break
    raise ImageDecodeError("JPEG is truncated: no frame header found")


def jpeg_scan_count(data: bytes, limit: int = MAX_JPEG_SCANS) -> int:
    """Scans (SOS segments) in a JPEG, walked from its markers without decoding.

    Raises:
        ImageDecodeError: more than ``limit`` scans or :data:`MAX_JPEG_SEGMENTS` segments,
            or a corrupt marker structure.
    """
    scans = segments = 0
    for marker, _, _ in _jpeg_segments(data):
        if marker == 0xD9:  # end of image
            break
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise ImageDecodeError(f"JPEG has more than {MAX_JPEG_SEGMENTS} marker segments; refused before decoding")
        if marker == 0xDA:
            scans += 1
            if scans > limit:
                raise ImageDecodeError(
                    f"JPEG has more than {limit} scans (each is a pass over the whole image); "
                    "refused before decoding: send a baseline JPEG or a PNG")
    return scans


def peek_size(data: bytes) -> tuple[str, tuple[int, int]]:
    """Format and ``(width, height)`` read from the header, without decoding.

    Raises:
        ImageDecodeError: not a PNG/JPEG, or a corrupt header.
    """
    fmt = sniff_format(data)
    if fmt == "png":
        return fmt, _png_size(data)
    if fmt == "jpeg":
        return fmt, _jpeg_size(data)
    raise ImageDecodeError("not a PNG or JPEG image (unknown file signature)")


def _complete(data: bytes, fmt: str) -> bool:
    tail = data[-4096:]
    if fmt == "png":
        return b"IEND" in tail
    return b"\xff\xd9" in tail


def decode_image(data: bytes, expected_size: tuple[int, int] | None = None,
                 max_jpeg_scans: int = MAX_JPEG_SCANS) -> np.ndarray:
    """Decode PNG or JPEG bytes into an RGB ``uint8`` image ``(H, W, 3)``.

    Grayscale, gray+alpha, RGBA and 16-bit images are converted (alpha dropped, 16-bit
    scaled to 8 bits by its high byte).

    Args:
        data: the file's bytes.
        expected_size: ``(width, height)``; another size raises :class:`ImageSizeError`
            before anything is decoded.
        max_jpeg_scans: a JPEG with more scans is refused before decoding.

    Raises:
        ImageDecodeError: empty, unknown, truncated or undecodable data.
        ImageSizeError: a size other than ``expected_size``.
    """
    if not data:
        raise ImageDecodeError("empty body: expected the bytes of a PNG or JPEG frame")
    fmt, (w, h) = peek_size(data)
    if w <= 0 or h <= 0 or w * h > MAX_PIXELS:
        raise ImageDecodeError(f"{fmt.upper()} declares an impossible size {w}x{h}")
    if expected_size is not None and (w, h) != tuple(expected_size):
        raise ImageSizeError(
            f"frame is {w}x{h} but the calibration's image_size is {expected_size[0]}x{expected_size[1]}: "
            "send frames from the calibrated camera at its calibrated resolution"
        )
    if not _complete(data, fmt):
        raise ImageDecodeError(f"{fmt.upper()} data is truncated (no end marker)")
    if fmt == "jpeg":
        jpeg_scan_count(data, max_jpeg_scans)
    buf = np.frombuffer(data, dtype=np.uint8)
    try:
        img = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
    except cv2.error as exc:
        raise ImageDecodeError(f"cannot decode {fmt.upper()}: {exc}") from exc
    if img is None or img.size == 0:
        raise ImageDecodeError(f"cannot decode {fmt.upper()} data (corrupt)")
    if img.shape[0] != h or img.shape[1] != w:
        raise ImageDecodeError(f"{fmt.upper()} decoded to {img.shape[1]}x{img.shape[0]}, header says {w}x{h}")
    return to_rgb(img)


def to_rgb(img: np.ndarray) -> np.ndarray:
    """OpenCV's decoded layout (gray, BGR, BGRA; 8 or 16 bit) -> RGB ``uint8``."""
    if img.ndim == 3 and img.shape[2] == 3:
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    elif img.ndim == 3 and img.shape[2] == 4:
        img = cv2.cvtColor(img, cv2.COLOR_BGRA2RGB)
    elif img.ndim == 3 and img.shape[2] == 2:  # gray + alpha
        img = img[:, :, 0]
    if img.dtype not in (np.uint8, np.uint16):
        raise ImageDecodeError(f"unsupported sample type {img.dtype}")
    return ensure_rgb8(img)


def encode_image(rgb: np.ndarray, fmt: str = "png", quality: int = 95) -> bytes:
    """Encode an RGB ``uint8`` image as PNG or JPEG bytes."""
    bgr = cv2.cvtColor(ensure_rgb8(rgb), cv2.COLOR_RGB2BGR)
    if fmt == "png":
        ok, buf = cv2.imencode(".png", bgr, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    elif fmt in ("jpeg", "jpg"):
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    else:
        raise ValueError(f"unknown image format {fmt!r}; use png or jpeg")
    if not ok:
        raise ValueError("OpenCV could not encode the image")
    return buf.tobytes()


def read_image(path: str | Path, expected_size: tuple[int, int] | None = None) -> np.ndarray:
    """Read a PNG/JPEG file as RGB ``uint8``; errors name the file."""
    path = Path(path)
    try:
        return decode_image(path.read_bytes(), expected_size)
    except OSError as exc:
        raise ImageDecodeError(f"cannot read {path}: {exc}") from exc
    except ImageDecodeError as exc:
        raise type(exc)(f"{path}: {exc}") from exc


def write_image(path: str | Path, rgb: np.ndarray) -> None:
    """Write an RGB image atomically; the format follows the suffix (``.png``/``.jpg``)."""
    path = Path(path)
    fmt = "png" if path.suffix.lower() == ".png" else "jpeg"
    atomic_write_bytes(path, encode_image(rgb, fmt))
