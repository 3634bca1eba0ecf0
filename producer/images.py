"""One image at submit: fetched, checked, measured, stored once (:class:`ImageResolver`).

A value (what a row's content part or images column holds: :mod:`producer.image_parts`) is the dataset's own bytes,
never re-encoded — the HF ``Image`` feature's too: a ``data:image/…;base64,…`` URI, an ``http(s)://`` or ``s3://``
URL (fetched here, at submit: workers never fetch), a local path — relative to the dataset file's directory (its
prefix, for an ``s3://`` dataset) — or an HF ``Image`` struct ``{bytes, path}``.

Each distinct image is checked once: at most ``THINKFLEET_MAX_IMAGE_BYTES``, an image Pillow decodes whole in an
accepted format, at most ``THINKFLEET_MAX_IMAGE_PIXELS``, and one the model's image processor takes
(thinkfleet/vision.py, which also counts its tokens); it is then written to the job's image store
(storage/images.py) and the row's message carries its :class:`thinkfleet.vision.ImageRef`. A bad image is a row
problem naming the image and the fix; what the model directory lacks for images at all (no
``preprocessor_config.json``, no placeholder token, a text-only ``config.json``: :func:`load_vision`) stops the
submit at the first image row (:class:`producer.sources.InputError`). After rendering, :func:`place_images` finds
each image's one placeholder in the ids.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import hashlib
import io
import json
import os
import posixpath
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from producer.sources import S3_SCHEMES, InputError, Source
from storage.images import EXTENSIONS, MIME, ImageStore
from thinkfleet import vision
from thinkfleet.vision import ImageRef, ImageRule, Placeholder, VisionError

#: Distinct images remembered by source (a repeated path or URL is fetched and checked once per submit).
CACHE_ENTRIES = 100_000
#: Formats accepted, as users name them.
FORMATS_TEXT = "PNG, JPEG, WebP, GIF, BMP or TIFF"


class ImageError(ValueError):
    """One image of a row cannot be used; the text names it and the fix (the reader adds the row)."""


@dataclass(frozen=True)
class Vision:
    """What a model directory says about images: the token-count rule and the placeholder token."""

    rule: ImageRule
    placeholder: Placeholder


def load_vision(tok: Any, source: str) -> Vision:
    """The vision of the model at ``source`` (the ``--tokenizer`` directory); :class:`VisionError` naming the file
    and the fix when it has none."""
    config = _model_json(source, "config.json")
    if config is not None and not _has_vision(config):
        raise VisionError(
            f"{source}/config.json has no vision_config: a text-only model (SGLang reports has_image_understanding "
            "false for it); image prompts need a vision-language model's directory as --tokenizer"
        )
    where = f"{source}/{vision.PREPROCESSOR_CONFIG}"
    processor = _model_json(source, vision.PREPROCESSOR_CONFIG)
    if processor is None:
        raise VisionError(
            f"{where}: no such file; the image token counts come from the model's image processor sizes in it: pass "
            f"--tokenizer the model's own directory, or copy its {vision.PREPROCESSOR_CONFIG} next to the tokenizer"
        )
    rule = vision.image_rule(processor, where)
    return Vision(rule, vision.placeholder(tok, rule, source))


def _has_vision(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict) or "image_token_id" in config


def _model_json(source: str, name: str) -> dict[str, Any] | None:
    """A JSON file next to the tokenizer (a directory, or the local hub cache); None when there is none."""
    path = Path(source).expanduser() / name
    if not path.is_file():
        try:
            from transformers.utils import cached_file

            found = cached_file(source, name, local_files_only=True, _raise_exceptions_for_missing_entries=False)
        except Exception:
            found = None
        if not found:
            return None
        path = Path(found)
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VisionError(f"{path}: not readable JSON ({e}); fix or replace the file") from e
    if not isinstance(value, dict):
        raise VisionError(f"{path}: a JSON {type(value).__name__}, not an object; fix or replace the file")
    return value


class ImageResolver:
    """Every image of a submit: fetched and checked once per distinct source, stored once per distinct content."""

    def __init__(
        self,
        store: ImageStore,
        tok: Any,
        tokenizer: str,
        *,
        max_bytes: int,
        max_pixels: int,
        fetch_timeout_s: float,
        s3_endpoint_url: str | None = None,
        refuse: str | None = None,
    ) -> None:
        self.store, self.tok, self.tokenizer = store, tok, tokenizer
        self.max_bytes, self.max_pixels, self.fetch_timeout_s = max_bytes, max_pixels, fetch_timeout_s
        self.s3_endpoint_url = s3_endpoint_url
        #: Why this submit takes no image rows at all (each one is then a row problem saying so).
        self.refuse = refuse
        self._vision: Vision | VisionError | None = None
        self._cache: collections.OrderedDict[Any, ImageRef] = collections.OrderedDict()
        self.images_read = 0  # distinct sources fetched and checked

    @property
    def vision(self) -> Vision:
        """The model's image rule and placeholder, read at the first image (a text job never needs them)."""
        if self._vision is None:
            try:
                self._vision = load_vision(self.tok, self.tokenizer)
            except VisionError as e:
                self._vision = e
        if isinstance(self._vision, VisionError):
            raise InputError(f"this submit has image rows, but {self._vision}")
        return self._vision

    @property
    def used(self) -> bool:
        """Whether this submit read the model's vision (it met an image row): the job record then names the store."""
        return isinstance(self._vision, Vision)

    def resolve(self, value: Any, base: DatasetBase, what: str) -> ImageRef:
        """The reference of one image (``what`` names it in errors: "image 2 (photo.png)"); ImageError if bad."""
        if self.refuse:
            raise ImageError(self.refuse)
        rule = self.vision.rule
        key, load = self._source(value, base, what)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        ref = self._check(load(), what, rule)
        self._cache[key] = ref
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        self.images_read += 1
        return ref

    # -- where the bytes come from ----------------------------------------------------------------------------
    def _source(self, value: Any, base: DatasetBase, what: str) -> tuple[Any, Any]:
        """(cache key, a loader of the bytes) of one image value."""
        if isinstance(value, dict):  # the HF Image feature's {bytes, path}; {"url": …}
            if isinstance(value.get("bytes"), bytes | bytearray) and value["bytes"]:
                value = bytes(value["bytes"])
            else:
                value = value.get("path") or value.get("url")
        if isinstance(value, bytes | bytearray):
            data = bytes(value)
            return ("sha256", hashlib.sha256(data).hexdigest()), lambda: data
        if _is_pil(value):
            data = _png(value)
            return ("sha256", hashlib.sha256(data).hexdigest()), lambda: data
        if not isinstance(value, str) or not value.strip():
            raise ImageError(f"{what} is {type(value).__name__} {str(value)[:60]!r}, not an image: give a data: URI, a "
                             "URL, a path or image bytes")  # fmt: skip
        text = value.strip()
        if text.startswith("data:"):
            return ("data", hashlib.sha256(text.encode()).hexdigest()), lambda: self._data_uri(text, what)
        if text.startswith(("http://", "https://")):
            return ("url", text), lambda: self._http(text, what)
        if text.startswith(S3_SCHEMES):
            return ("url", text), lambda: self._s3(text, what)
        fs, path = base.locate(text)
        return (base.kind, path), lambda: self._file(fs, path, text, what)

    def _data_uri(self, text: str, what: str) -> bytes:
        head, sep, body = text.partition(",")
        if not sep:
            raise ImageError(f"{what}: a data: URI without ','; use data:image/<format>;base64,<data>")
        try:
            if head.endswith(";base64"):
                if len(body) > self.max_bytes * 4 // 3 + 4:
                    raise ImageError(self._too_big(what, len(body) * 3 // 4))
                return base64.b64decode(body, validate=True)
            return urllib.parse.unquote_to_bytes(body)
        except (binascii.Error, ValueError) as e:
            if isinstance(e, ImageError):
                raise
            raise ImageError(f"{what}: the data: URI's base64 does not decode ({e}); re-encode the image") from e

    def _http(self, url: str, what: str) -> bytes:
        try:
            request = urllib.request.Request(url, headers={"User-Agent": "thinkfleet-producer"})
            with urllib.request.urlopen(request, timeout=self.fetch_timeout_s) as response:
                return self._bounded(response, what)
        except urllib.error.HTTPError as e:
            raise ImageError(f"{what}: {url} answered HTTP {e.code} {e.reason}; fix the URL") from e
        except (urllib.error.URLError, OSError) as e:
            raise ImageError(
                f"{what}: cannot fetch {url} ({getattr(e, 'reason', e)}; timeout "
                f"{self.fetch_timeout_s:g} s: THINKFLEET_IMAGE_FETCH_TIMEOUT_S); check the URL and the network"
            ) from e

    def _s3(self, uri: str, what: str) -> bytes:
        from storage.layout import locate

        try:
            loc = locate(uri, self.s3_endpoint_url)
            with loc.fs.open_input_stream(loc.root) as f:
                return self._bounded(f, what)
        except (OSError, ValueError) as e:
            if isinstance(e, ImageError):
                raise
            raise ImageError(f"{what}: cannot read {uri} ({e}); check the URI, credentials and "
                             "THINKFLEET_S3_ENDPOINT_URL") from e  # fmt: skip

    def _file(self, fs: pafs.FileSystem, path: str, given: str, what: str) -> bytes:
        try:
            with fs.open_input_stream(path) as f:
                return self._bounded(f, what)
        except FileNotFoundError as e:
            raise ImageError(
                f"{what}: no file {path} (a relative path is read from the dataset file's directory); fix the path"
            ) from e
        except OSError as e:
            raise ImageError(f"{what}: cannot read {path} ({e}); fix the path or its permissions") from e

    def _bounded(self, f: Any, what: str) -> bytes:
        data = f.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:
            raise ImageError(self._too_big(what, None))
        return data

    def _too_big(self, what: str, size: int | None) -> str:
        size_text = f" ({size:,} bytes)" if size is not None else ""
        return (
            f"{what}{size_text} is over THINKFLEET_MAX_IMAGE_BYTES ({self.max_bytes:,} bytes); shrink the image or "
            "raise the setting"
        )

    # -- what the bytes must be ---------------------------------------------------------------------------------
    def _check(self, data: bytes, what: str, rule: ImageRule) -> ImageRef:
        """Decode ``data`` whole (Pillow), check it, count its tokens, store it: its reference."""
        from PIL import Image, UnidentifiedImageError

        if len(data) > self.max_bytes:
            raise ImageError(self._too_big(what, len(data)))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
                width, height = image.size  # as stored: SGLang's loader applies no EXIF rotation either
                if width * height > self.max_pixels:
                    raise ImageError(
                        f"{what} is {width}×{height} px, over THINKFLEET_MAX_IMAGE_PIXELS ({self.max_pixels:,}); "
                        "downscale it or raise the setting"
                    )
                if image.format not in EXTENSIONS:
                    raise ImageError(f"{what} is {image.format or 'an unknown format'}; use {FORMATS_TEXT}")
                image.load()  # the whole image decodes: a truncated file fails here, not on the GPU host
        except ImageError:
            raise
        except UnidentifiedImageError as e:
            raise ImageError(f"{what} is not an image ({FORMATS_TEXT}); replace it") from e
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"{what} does not decode ({type(e).__name__}: {e}); replace it") from e
        try:
            tokens = rule.tokens(width, height)
        except VisionError as e:
            raise ImageError(f"{what}: {e}") from e
        sha256 = hashlib.sha256(data).hexdigest()
        ext = EXTENSIONS[image.format]
        try:
            uri = self.store.put(sha256, ext, data)
        except OSError as e:  # the store itself: no row can help, stop the submit
            raise InputError(f"cannot write to the image store {self.store.loc.uri(self.store.loc.root)}: {e}") from e
        return ImageRef(sha256, uri, MIME[ext], width, height, tokens)


def _is_pil(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.")


def _png(image: Any) -> bytes:
    """A decoded PIL image (a dataset read with decoding on) as PNG bytes: the pixels kept, the file's bytes lost."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class DatasetBase:
    """Where a dataset's relative image paths are read from: its file's directory (or the directory it is)."""

    kind: str  # local | s3 | hub
    fs: pafs.FileSystem | None
    directory: str

    @classmethod
    def of(cls, source: Source) -> DatasetBase:
        if source.kind == "hub" or source.fs is None:
            return cls("hub", None, "")
        info = source.fs.get_file_info(source.path)
        directory = source.path if info.type == pafs.FileType.Directory else posixpath.dirname(source.path)
        return cls(source.kind, source.fs, directory)

    def locate(self, text: str) -> tuple[pafs.FileSystem, str]:
        """(filesystem, path) of a path given in the dataset."""
        if text.startswith("file://"):
            text = urllib.parse.urlparse(text).path
        if os.path.isabs(text) or text.startswith("~"):
            return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(text))
        if self.fs is None:
            raise ImageError(f"image path {text!r} is relative, and a hub dataset has no directory; give it whole")
        if self.kind == "local":
            return self.fs, os.path.normpath(os.path.join(self.directory, text))
        return self.fs, posixpath.normpath(posixpath.join(self.directory, text))


def place_images(ids: Any, refs: tuple[ImageRef, ...], placeholder: Placeholder) -> tuple[ImageRef, ...]:
    """``refs`` with the position of each one's placeholder in the rendered ``ids``; ImageError when the chat template
    did not render exactly one placeholder per image (a template that drops image parts, or text that spells the
    placeholder token itself)."""
    import numpy as np

    positions = np.flatnonzero(np.asarray(ids) == placeholder.token_id).tolist()
    if len(positions) != len(refs):
        raise ImageError(
            f"the chat template rendered {len(positions)} {placeholder.token} placeholder(s) for {len(refs)} image(s); "
            "it must render one per image part: check that --tokenizer is the vision model's own, and that no text "
            f"spells {placeholder.token}"
        )
    return tuple(dataclasses.replace(ref, position=int(p)) for ref, p in zip(refs, positions, strict=True))


def image_resolver(settings: Any, job: str, tokenizer: str, tok: Any, *, dry_run: bool, turns: str) -> ImageResolver:
    """What reads a submit's images: the job's store (``THINKFLEET_IMAGE_STORE_URI`` or beside the job; a dry run
    writes nothing) and the settings' limits. ``--turns all`` takes image rows too: each later turn's history keeps
    its images, one placeholder each (workers/turns.py)."""
    store = ImageStore.for_job(settings.output_uri, job, settings.image_store_uri, settings.s3_endpoint_url, dry_run)
    return ImageResolver(
        store, tok, tokenizer, max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels,
        fetch_timeout_s=settings.image_fetch_timeout_s, s3_endpoint_url=settings.s3_endpoint_url,
    )  # fmt: skip
