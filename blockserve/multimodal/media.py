"""An image that arrives as a URL (data:, http(s), file://), fetched within its bounds (time,
size, which hosts and directories) and decoded as vLLM's chat loader decodes it: EXIF
orientation applied, RGB with transparency on white, a huge claimed size refused first."""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import ipaddress
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

import httpx
from PIL import Image, ImageOps

from blockserve.errors import InvalidRequestError
from blockserve.multimodal.hasher import EncodedImage

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
RGB_CONVERSION = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from. `allowed_domains` (--allowed-media-domains): only these
    hosts, at whatever address; empty: any host whose addresses are all public (a loopback,
    private, link-local or reserved one is refused, the server's own network included).
    `local_path` (--allowed-local-media-path): the directory file:// URLs may read below;
    None: none. A fetch gets `fetch_timeout_s` in all (VLLM_IMAGE_FETCH_TIMEOUT) and
    `max_bytes`; redirects are not followed."""

    allowed_domains: tuple[str, ...] = ()
    local_path: Path | None = None
    fetch_timeout_s: float = 5.0
    max_bytes: int = 20 << 20


def load_image_url(url: str, policy: MediaPolicy, param: str) -> EncodedImage:
    """An `image_url` part's image, by its URL's scheme; InvalidRequestError naming `param`
    for anything the policy refuses or that is not an image."""
    if url.startswith("data:"):
        return decode_data_url(url, policy.max_bytes, param)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise InvalidRequestError(f"the image URL cannot be read: {exc}", param) from None
    if parts.scheme in ("http", "https"):
        return decode_image(_fetch(url, parts, policy, param), param)
    if parts.scheme == "file":
        return decode_image(_read_local(parts, policy, param), param)
    raise InvalidRequestError(
        f"an image_url is a data:, http(s) or file:// URL, got {parts.scheme or url!r}", param
    )


def _fetch(url: str, parts: SplitResult, policy: MediaPolicy, param: str) -> bytes:
    host = parts.hostname or ""
    if policy.allowed_domains:
        if host not in policy.allowed_domains:
            raise InvalidRequestError(
                f"the image's host {host!r} is not in --allowed-media-domains", param
            )
    elif not _public(host, parts.port or (443 if parts.scheme == "https" else 80)):
        raise InvalidRequestError(
            f"the image's host {host!r} is not a public address (--allowed-media-domains "
            "admits a host by name)",
            param,
        )
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        with (
            httpx.Client(timeout=policy.fetch_timeout_s, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise InvalidRequestError(f"the image URL answered {response.status_code}", param)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > policy.max_bytes:
                    raise InvalidRequestError(
                        f"the image is larger than {policy.max_bytes} bytes", param
                    )
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the whole fetch took too long")
            return bytes(body)
    except httpx.TimeoutException:
        raise InvalidRequestError(
            f"the image URL did not answer within {policy.fetch_timeout_s:g} s "
            "(VLLM_IMAGE_FETCH_TIMEOUT)",
            param,
        ) from None
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"the image could not be fetched: {exc}", param) from None


def _public(host: str, port: int) -> bool:
    """Whether every address `host` resolves to is a public one."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    return bool(addresses) and all(address.is_global for address in addresses)


def _read_local(parts: SplitResult, policy: MediaPolicy, param: str) -> bytes:
    if policy.local_path is None:
        raise InvalidRequestError("file:// image URLs need --allowed-local-media-path", param)
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(policy.local_path) or not path.is_file():
        raise InvalidRequestError(
            "the image file is not a file under --allowed-local-media-path", param
        )
    if path.stat().st_size > policy.max_bytes:
        raise InvalidRequestError(f"the image is larger than {policy.max_bytes} bytes", param)
    return path.read_bytes()


def decode_data_url(url: str, max_bytes: int, param: str) -> EncodedImage:
    """A `data:image/...;base64,...` URL's image; InvalidRequestError naming `param` for a URL
    of another kind, one whose bytes would pass `max_bytes` (refused before decoding), or bytes
    that are not an image Pillow may decode."""
    head, comma, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
        raise InvalidRequestError("a data: image URL is data:image/...;base64,...", param)
    if len(data) // 4 * 3 > max_bytes:
        raise InvalidRequestError(f"the image is larger than {max_bytes} bytes", param)
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise InvalidRequestError(f"the image's base64 cannot be read: {exc}", param) from None
    return decode_image(raw, param)


def decode_image(raw: bytes, param: str) -> EncodedImage:
    """Opening reads the header alone: Pillow refuses there an image of more than twice its
    MAX_IMAGE_PIXELS (178,956,970 pixels, vLLM's VLLM_MAX_IMAGE_PIXELS default), before any
    pixel is decoded; a truncated or foreign file fails at load."""
    try:
        image: Image.Image = Image.open(io.BytesIO(raw), formats=FORMATS)
        with contextlib.suppress(Exception):  # a malformed orientation tag: as it is
            image = ImageOps.exif_transpose(image)
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"the image cannot be read: {exc}", param) from None
    converted = to_rgb(image)
    return EncodedImage(converted, raw, None if converted is image else RGB_CONVERSION)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as vLLM converts it: transparency flattened onto white, other modes converted."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.split()[3])
        return flat
    return image.convert("RGB")
