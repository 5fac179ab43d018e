"""Images for the demo: drawn with PIL from a seed, plus scikit-image's sample photos when
that package is installed."""

from __future__ import annotations

import base64
import importlib.util
import io
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["DemoImage", "demo_images"]

#: scikit-image sample photos used when it is installed (names of ``skimage.data``).
_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


@dataclass(frozen=True, slots=True)
class DemoImage:
    name: str
    #: The RGB image exactly as the encoder decodes it from ``data_url``.
    image: Image.Image
    #: A PNG data URL (lossless, so both sides of the parity check see the same pixels).
    data_url: str


def _encode(name: str, image: Image.Image) -> DemoImage:
    from PIL import Image as PILImage

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    decoded = PILImage.open(io.BytesIO(data)).convert("RGB")
    url = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return DemoImage(name, decoded, url)


def _drawn(rng: random.Random, index: int, min_side: int, max_side: int) -> DemoImage:
    from PIL import Image as PILImage, ImageDraw

    width, height = rng.randint(min_side, max_side), rng.randint(min_side, max_side)

    def colour() -> tuple[int, int, int]:
        return (rng.randrange(256), rng.randrange(256), rng.randrange(256))

    image = PILImage.new("RGB", (width, height), colour())
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(2, 6)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = rng.randint(x0, width), rng.randint(y0, height)
        shape = rng.choice(("ellipse", "rectangle", "line"))
        if shape == "ellipse":
            draw.ellipse((x0, y0, x1, y1), fill=colour())
        elif shape == "rectangle":
            draw.rectangle((x0, y0, x1, y1), fill=colour())
        else:
            draw.line((x0, y0, x1, y1), fill=colour(), width=rng.randint(1, 4))
    return _encode(f"drawn-{index}", image)


def _photos(max_side: int) -> list[DemoImage]:
    if importlib.util.find_spec("skimage") is None:
        return []
    from PIL import Image as PILImage
    from skimage import data as samples  # type: ignore[import-not-found,unused-ignore]

    photos = []
    for name in _PHOTOS:
        loader = getattr(samples, name, None)
        if loader is None:
            continue
        try:
            array = loader()
        except Exception:  # sample data missing from this install
            continue
        image = PILImage.fromarray(array).convert("RGB")
        image.thumbnail((max_side, max_side))
        photos.append(_encode(f"skimage-{name}", image))
    return photos


def demo_images(
    count: int, *, seed: int, min_side: int = 56, max_side: int = 112
) -> list[DemoImage]:
    """``count`` images: scikit-image's sample photos first (if installed), then drawn ones.

    Deterministic for a seed. Blocks (PNG encoding).
    """
    rng = random.Random(seed)
    images = _photos(max_side)[:count]
    while len(images) < count:
        images.append(_drawn(rng, len(images), min_side, max_side))
    return images
