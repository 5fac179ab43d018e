from __future__ import annotations

import base64
import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from encdisagg import BadRequestError
from encdisagg.models import MediaPolicy, load_image, load_video

from ._media_samples import encode, make_image

POLICY = MediaPolicy()


def assert_same_pixels(a: Image.Image, b: Image.Image) -> None:
    assert a.mode == b.mode == "RGB"
    assert a.size == b.size
    assert a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return make_image(40, 30, seed=3)


@pytest.fixture(scope="module")
def png(picture: Image.Image) -> bytes:
    return encode(picture)


class TestImageForms:
    def test_bytes_and_bytearray(self, picture: Image.Image, png: bytes) -> None:
        assert_same_pixels(load_image(png, 0, POLICY), picture)
        assert_same_pixels(load_image(bytearray(png), 0, POLICY), picture)
        assert_same_pixels(load_image(memoryview(png), 0, POLICY), picture)

    def test_paths(self, tmp_path: Path, picture: Image.Image, png: bytes) -> None:
        path = tmp_path / "picture.png"
        path.write_bytes(png)
        assert_same_pixels(load_image(path, 0, POLICY), picture)
        assert_same_pixels(load_image(str(path), 0, POLICY), picture)
        assert_same_pixels(load_image(path.as_uri(), 0, POLICY), picture)

    def test_data_url_and_bare_base64(self, picture: Image.Image, png: bytes) -> None:
        b64 = base64.b64encode(png).decode()
        assert_same_pixels(load_image(f"data:image/png;base64,{b64}", 0, POLICY), picture)
        assert_same_pixels(load_image(b64, 0, POLICY), picture)

    def test_pil_images_are_converted_to_rgb(self, picture: Image.Image) -> None:
        rgba = picture.convert("RGBA")
        assert_same_pixels(load_image(rgba, 0, POLICY), picture)
        gray = load_image(picture.convert("L"), 0, POLICY)
        assert gray.mode == "RGB"

    @pytest.mark.parametrize(
        ("fmt", "options"),
        [("JPEG", {"quality": 90}), ("WEBP", {"lossless": True}), ("BMP", {}), ("GIF", {})],
    )
    def test_any_pil_format(
        self, picture: Image.Image, fmt: str, options: dict[str, object]
    ) -> None:
        decoded = load_image(encode(picture, fmt, **options), 0, POLICY)
        assert decoded.mode == "RGB"
        assert decoded.size == picture.size

    def test_palette_and_alpha_images_decode_to_rgb(self, picture: Image.Image) -> None:
        decoded = load_image(encode(picture.convert("P")), 0, POLICY)
        assert decoded.mode == "RGB"
        decoded = load_image(encode(picture.convert("LA")), 0, POLICY)
        assert decoded.mode == "RGB"

    def test_dict_with_matching_content_hash(self, picture: Image.Image, png: bytes) -> None:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        digest = hashlib.sha256(png).hexdigest()
        assert_same_pixels(load_image({"url": url, "content_hash": digest}, 0, POLICY), picture)
        upper = {"url": url, "content_hash": digest.upper()}
        assert_same_pixels(load_image(upper, 0, POLICY), picture)
        assert_same_pixels(load_image({"url": url}, 0, POLICY), picture)


class TestImageErrors:
    def test_undecodable_bytes_name_the_item(self) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[2\]: cannot decode image") as info:
            load_image(b"definitely not an image", 2, POLICY)
        assert info.value.status == 400

    def test_truncated_image(self, png: bytes) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot decode image"):
            load_image(png[: len(png) // 2], 0, POLICY)

    def test_wrong_content_hash(self, png: bytes) -> None:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        wrong = hashlib.sha256(png + b"x").hexdigest()
        with pytest.raises(BadRequestError, match=r"mm_items\[1\]\.content_hash does not match"):
            load_image({"url": url, "content_hash": wrong}, 1, POLICY)

    @pytest.mark.parametrize("content_hash", ["abc", 12, "g" * 64])
    def test_malformed_content_hash(self, png: bytes, content_hash: object) -> None:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]\.content_hash must be"):
            load_image({"url": url, "content_hash": content_hash}, 0, POLICY)

    def test_dict_fields_are_checked(self) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: unknown key 'uri'"):
            load_image({"uri": "x"}, 0, POLICY)
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]\.url must be a string"):
            load_image({"url": 5}, 0, POLICY)

    def test_oversized_items(self, tmp_path: Path, png: bytes) -> None:
        small = MediaPolicy(max_media_bytes=len(png) - 1)
        with pytest.raises(BadRequestError, match=r"mm_items\[3\]: .*max_media_bytes"):
            load_image(png, 3, small)
        path = tmp_path / "big.png"
        path.write_bytes(png)
        with pytest.raises(BadRequestError, match="max_media_bytes"):
            load_image(path, 0, small)
        b64 = base64.b64encode(png).decode()
        with pytest.raises(BadRequestError, match="max_media_bytes"):
            load_image("data:image/png;base64," + b64, 0, small)

    def test_bad_data_urls(self) -> None:
        with pytest.raises(BadRequestError, match="only base64 data URLs"):
            load_image("data:text/plain,hello", 0, POLICY)
        with pytest.raises(BadRequestError, match="invalid base64"):
            load_image("data:image/png;base64,@@@", 0, POLICY)

    def test_missing_files(self, tmp_path: Path) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: no such file"):
            load_image(str(tmp_path / "nope.png"), 0, POLICY)
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot read file"):
            load_image(tmp_path / "nope.png", 0, POLICY)

    def test_local_files_can_be_refused(self, tmp_path: Path, png: bytes) -> None:
        path = tmp_path / "picture.png"
        path.write_bytes(png)
        closed = MediaPolicy(allow_local_files=False)
        for item in (path, str(path), path.as_uri()):
            with pytest.raises(BadRequestError, match="local file paths are not allowed"):
                load_image(item, 0, closed)

    def test_unsupported_item_types(self) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[4\]: unsupported item type int"):
            load_image(7, 4, POLICY)

    def test_garbage_string(self) -> None:
        with pytest.raises(BadRequestError, match="not a file, a data URL"):
            load_image("hello world!", 0, POLICY)


class TestRemote:
    def test_refused_by_default(self) -> None:
        with pytest.raises(BadRequestError, match="remote media URLs are disabled") as info:
            load_image("https://example.com/cat.png", 0, POLICY)
        assert "mm_items[0]" in str(info.value)

    def test_refused_outside_the_allow_list(self) -> None:
        policy = MediaPolicy(remote_media_domains=("example.com",))
        for url in ("https://evil.com/cat.png", "http://notexample.com/x", "https://example.co/"):
            with pytest.raises(BadRequestError, match="is not in remote_media_domains"):
                load_image(url, 0, policy)
        with pytest.raises(BadRequestError, match="not in remote_media_domains"):
            load_image({"url": "https://evil.com/cat.png"}, 0, policy)

    def test_subdomains_are_allowed(self) -> None:
        policy = MediaPolicy(remote_media_domains=(".Example.COM",))
        assert policy.remote_media_domains == ("example.com",)
        assert policy.allows_domain("cdn.example.com")
        assert policy.allows_domain("EXAMPLE.com.")
        assert not policy.allows_domain("badexample.com")

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("max_media_bytes", 0),
            ("max_video_frames", True),
            ("remote_timeout_s", 0.0),
            ("remote_media_domains", "example.com"),
            ("remote_media_domains", ("",)),
        ],
    )
    def test_policy_fields_are_validated(self, field: str, value: object) -> None:
        with pytest.raises(BadRequestError, match=field):
            MediaPolicy(**{field: value})  # type: ignore[arg-type]


class _Handler(http.server.BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self) -> None:
        if self.path == "/picture.png":
            self._send(200, self.payload)
        elif self.path == "/elsewhere":
            self.send_response(302)
            self.send_header("Location", "http://media.invalid/picture.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/again":
            self.send_response(302)
            self.send_header("Location", "/picture.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"missing")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def media_server(png: bytes, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real HTTP server on loopback serving ``/picture.png``; yields its base URL."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    handler = type("Handler", (_Handler,), {"payload": png})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class TestRemoteFetch:
    def test_allow_listed_fetch(self, media_server: str, picture: Image.Image, png: bytes) -> None:
        policy = MediaPolicy(remote_media_domains=("127.0.0.1",))
        assert_same_pixels(load_image(f"{media_server}/picture.png", 0, policy), picture)
        digest = hashlib.sha256(png).hexdigest()
        item = {"url": f"{media_server}/again", "content_hash": digest}
        assert_same_pixels(load_image(item, 0, policy), picture)

    def test_redirect_out_of_the_allow_list_is_refused(self, media_server: str) -> None:
        policy = MediaPolicy(remote_media_domains=("127.0.0.1",))
        with pytest.raises(BadRequestError, match=r"'media\.invalid' is not in remote_media"):
            load_image(f"{media_server}/elsewhere", 0, policy)

    def test_size_cap_applies_to_downloads(self, media_server: str, png: bytes) -> None:
        policy = MediaPolicy(remote_media_domains=("127.0.0.1",), max_media_bytes=len(png) - 1)
        with pytest.raises(BadRequestError, match="max_media_bytes"):
            load_image(f"{media_server}/picture.png", 0, policy)

    def test_http_errors(self, media_server: str) -> None:
        policy = MediaPolicy(remote_media_domains=("127.0.0.1",))
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot fetch .*404"):
            load_image(f"{media_server}/nothing.png", 0, policy)


class TestVideo:
    def test_frame_list_in_mixed_forms(self, tmp_path: Path) -> None:
        frames = [make_image(32, 24, seed=seed) for seed in range(3)]
        path = tmp_path / "frame.png"
        path.write_bytes(encode(frames[1]))
        b64 = base64.b64encode(encode(frames[2])).decode()
        decoded = load_video([frames[0], path, f"data:image/png;base64,{b64}"], 0, POLICY)
        assert len(decoded) == 3
        for got, want in zip(decoded, frames, strict=True):
            assert_same_pixels(got, want)

    def test_animated_image_file(self) -> None:
        frames = [make_image(32, 24, seed=seed) for seed in range(4)]
        webp = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
        decoded = load_video(webp, 0, POLICY)
        assert len(decoded) == 4
        for got, want in zip(decoded, frames, strict=True):
            assert_same_pixels(got, want)

    def test_long_files_are_sampled_down(self) -> None:
        frames = [make_image(8, 8, seed=seed) for seed in range(10)]
        webp = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
        decoded = load_video(webp, 0, MediaPolicy(max_video_frames=4))
        assert len(decoded) == 4
        assert_same_pixels(decoded[0], frames[0])

    def test_too_many_frames_in_a_list(self) -> None:
        frames = [make_image(8, 8)] * 5
        with pytest.raises(BadRequestError, match=r"mm_items\[1\]: video has 5 frames"):
            load_video(frames, 1, MediaPolicy(max_video_frames=4))

    def test_bad_frame_names_item_and_frame(self) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[1\]\[2\]: cannot decode image"):
            load_video([make_image(8, 8), make_image(8, 8), b"junk"], 1, POLICY)

    def test_empty_video(self) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: video has no frames"):
            load_video([], 0, POLICY)

    def test_undecodable_video_file(self) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot decode video"):
            load_video(b"\x00\x00\x00\x18ftypmp42 not really", 0, POLICY)

    def test_video_file_with_pyav(self, tmp_path: Path) -> None:
        av = pytest.importorskip("av")
        path = tmp_path / "clip.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("mpeg4", rate=4)
            stream.width, stream.height = 64, 48
            for seed in range(8):  # two seconds at 4 fps
                frame = av.VideoFrame.from_image(make_image(64, 48, seed=seed))
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
        decoded = load_video(path, 0, POLICY)
        assert len(decoded) == 4  # sampled at 2 fps
        assert all(frame.size == (64, 48) for frame in decoded)
