"""Hostile media, built byte by byte so that making them costs the test nothing.

The GIFs are what the attacker sends: a large logical screen (the canvas every frame is
composited on) and many frames of one pixel each, 23 bytes a frame. The PNG declares a huge
size and compresses to almost nothing.
"""

from __future__ import annotations

import struct
import zlib

# LZW stream (minimum code size 2) of a single pixel of colour 1: clear, 1, end.
_ONE_PIXEL_LZW = bytes([2, 2, 0x4C, 0x01, 0])


def gif_bomb(frames: int, width: int, height: int) -> bytes:
    """An animated GIF of ``frames`` one-pixel frames on a ``width`` x ``height`` canvas."""
    out = bytearray(b"GIF89a")
    # Logical screen; a global colour table of two entries (black, white).
    out += struct.pack("<HHBBB", width, height, 0x80, 0, 0)
    out += b"\x00\x00\x00\xff\xff\xff"
    for number in range(frames):
        # Graphic control: keep the previous frame (disposal 1), 40 ms.
        out += b"\x21\xf9\x04\x04" + struct.pack("<H", 4) + b"\x00\x00"
        x, y = number % width, (number // width) % height
        out += b"\x2c" + struct.pack("<HHHHB", x, y, 1, 1, 0)
        out += _ONE_PIXEL_LZW
    out += b"\x3b"
    return bytes(out)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data))
        + kind
        + data
        + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def png_bomb(width: int, height: int) -> bytes:
    """A valid one-bit PNG of ``width`` x ``height`` black pixels (a few KB per 10k^2)."""
    row = b"\x00" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", data)
        + _chunk(b"IEND", b"")
    )
