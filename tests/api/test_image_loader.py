"""A request's image parts → its job's images: each source kind, each distinct image once, the
per-request limit, and every refusal a 400 naming its part, counted by reason."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator

import pytest

from api.images.loader import ImageLoader
from api.images.refusal import ImageRefused
from api.metrics import Metrics
from api.settings import ApiSettings
from api.wire.openai.images import ImageLocator, ImageSource
from shared.errors import ErrorKind, RelayError
from tests.support.image_server import ImageServer, Reply, image_server, png_bytes

PNG_A, PNG_B, PNG_C = png_bytes(8, 6), png_bytes(5, 9, (0, 0, 255)), png_bytes(3, 3, (0, 255, 0))


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _source(param: str, url: str | None = None, file_id: str | None = None) -> ImageSource:
    return ImageSource(param, ImageLocator(url=url, file_id=file_id))


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with image_server() as running:
        running.replies["/b.png"] = Reply(body=PNG_B)
        running.replies["/words"] = Reply(body=b"<html>not an image</html>", headers={"Content-Type": "image/png"})
        yield running


def _loader(**settings: object) -> tuple[ImageLoader, Metrics]:
    metrics = Metrics()
    fields: dict[str, object] = {"allow_remote_images": True, "allowed_image_networks": "127.0.0.1/32", **settings}
    return ImageLoader(ApiSettings.model_validate(fields), metrics), metrics


async def _files(file_id: str) -> bytes:
    if file_id == "file-c":
        return PNG_C
    raise ImageRefused("file_not_found", f"No file with id `{file_id}`.")


def _count(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_data_remote_and_file_images_in_order(server: ImageServer) -> None:
    loader, metrics = _loader()
    sources = [_source("p0", url=_data_url(PNG_A)), _source("p1", url=server.url("/b.png")),
               _source("p2", file_id="file-c")]  # fmt: skip
    images = await loader.load(sources, _files)
    assert [images.refs[s.locator].sha256 for s in sources] == [hashlib.sha256(d).hexdigest()
                                                                 for d in (PNG_A, PNG_B, PNG_C)]  # fmt: skip
    assert [(r.width, r.height, r.media_type) for r in images.refs.values()] == [
        (8, 6, "image/png"), (5, 9, "image/png"), (3, 3, "image/png")
    ]  # fmt: skip
    assert dict(images.data) == {hashlib.sha256(d).hexdigest(): d for d in (PNG_A, PNG_B, PNG_C)}
    for source in ("data", "remote", "file"):
        assert _count(metrics, "relaylm:images_total", source=source) == 1
    assert _count(metrics, "relaylm:image_fetch_seconds_count") == 1
    assert _count(metrics, "relaylm:request_images_sum") == 3


async def test_an_image_sent_twice_is_loaded_once(server: ImageServer) -> None:
    loader, _ = _loader()
    url = server.url("/b.png?twice")
    server.replies["/b.png?twice"] = Reply(body=PNG_B)
    asked_before = len(server.seen)
    images = await loader.load([_source("p0", url=url), _source("p1", url=url)], _files)
    assert len(images.refs) == 1 and len(images.data) == 1
    assert len(server.seen) == asked_before + 1


async def _refusal(loader: ImageLoader, sources: list[ImageSource]) -> RelayError:
    with pytest.raises(RelayError) as refused:
        await loader.load(sources, _files)
    assert refused.value.kind is ErrorKind.INVALID_REQUEST and refused.value.status == 400
    return refused.value


@pytest.mark.parametrize(
    ("url", "reason", "words"),
    [
        ("data:image/png;base64,@@@", "malformed_data_url", "malformed"),
        (_data_url(b"GIF89a but no more"), "not_an_image", "not a PNG, JPEG, GIF or WebP"),
        ("{server}/words", "not_an_image", "not a PNG"),
        ("{server}/missing", "http_status", "404"),
        ("ftp://127.0.0.1/a.png", "unsupported_url", "data: URL or an http(s) URL"),
        (_data_url(png_bytes(200, 100)), "too_many_pixels", "200x100"),
        (_data_url(b"x" * 3000), "too_large", "2048 bytes"),
    ],
)
async def test_each_refusal_names_the_part_and_is_counted(
    server: ImageServer, url: str, reason: str, words: str
) -> None:
    loader, metrics = _loader(max_image_pixels=10_000, max_image_bytes=2048)
    good = _source("messages[0].content[0].image_url", url=_data_url(PNG_A))
    bad = _source("messages[0].content[1].image_url", url=url.format(server=f"http://127.0.0.1:{server.port}"))
    error = await _refusal(loader, [good, bad])
    assert error.param == "messages[0].content[1].image_url"
    assert words in error.message
    assert _count(metrics, "relaylm:image_refusals_total", reason=reason) == 1


async def test_remote_urls_are_refused_while_remote_images_are_off(server: ImageServer) -> None:
    loader, metrics = _loader(allow_remote_images=False)
    error = await _refusal(loader, [_source("input[0].content[1]", url=server.url("/b.png"))])
    assert error.param == "input[0].content[1]" and "--allow-remote-images" in error.message
    assert _count(metrics, "relaylm:image_refusals_total", reason="remote_off") == 1


async def test_a_file_refused_by_the_reader_names_its_part() -> None:
    loader, _ = _loader()
    error = await _refusal(loader, [_source("messages[2].content[0].source", file_id="file-other")])
    assert error.param == "messages[2].content[0].source" and "file-other" in error.message


async def test_past_the_image_limit_the_first_extra_part_is_named() -> None:
    loader, metrics = _loader(max_images_per_request=2)
    sources = [_source(f"messages[0].content[{i}].image_url", url=_data_url(PNG_A)) for i in range(3)]
    error = await _refusal(loader, sources)
    assert error.param == "messages[0].content[2].image_url" and "at most 2 images" in error.message
    assert _count(metrics, "relaylm:image_refusals_total", reason="too_many_images") == 1


async def test_no_sources_is_no_work() -> None:
    loader, metrics = _loader()
    images = await loader.load([], _files)
    assert not images.refs and not images.data
    assert _count(metrics, "relaylm:request_images_count") == 0
