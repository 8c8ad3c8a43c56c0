"""Image folders as a source: images with labels from class subfolders or a labels file."""

from __future__ import annotations

import csv
import io
import json
import os
import warnings
from typing import Any

import numpy as np

from .columns import image_size
from .errors import FormatError, SchemaError
from .jpeg_restart import add_restart_index, restart_supported
from .schema import Field, Schema

__all__ = ["IMAGE_EXTENSIONS", "LABEL_FILES", "ImageFolder", "check_image", "is_image", "labelled_images"]

LABEL_FILES = ("labels.csv", "labels.json")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def check_image(data: bytes, where: str) -> None:
    """Decode an encoded image fully; raise SchemaError naming `where` when it cannot be (truncated,
    corrupt, not an image). A header alone is not enough: a truncated JPEG has an intact one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except UnidentifiedImageError as exc:  # PIL's text names the in-memory file by its address
        raise SchemaError(f"{where}: not a decodable image (not in any image format PIL reads)") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise SchemaError(f"{where}: not a decodable image ({exc})") from exc


class ImageFolder:
    """Images and labels → ``{"image": encoded bytes, "label": int}``, files sorted.

    Labels come from `labels` (a CSV of ``file,label`` rows or a JSON object ``{file: label}``,
    files relative to `root`; ``labels.csv`` / ``labels.json`` in `root` are used when present),
    else from class subfolders (`root/<class>/<image>`, classes sorted). String labels become class
    indices (`classes`, sorted); integer labels are kept as they are (`classes` is None). A folder
    without class subfolders (or with one) and no labels file warns that every label is 0.
    With `decode_check` (default) every image is decoded fully as it is read; errors name the file.
    With `jpeg_restart` (default) each JPEG is stored re-encoded losslessly with restart markers
    (column groups of about 64 pixels in every MCU row) and a restart index
    (`jpeg_restart.add_restart_index`: same pixels), so the image preset decodes only the restart
    intervals a crop window covers instead of every row from the top of the image.
    """

    def __init__(
        self, root: str, *, decode_check: bool = True, labels: str | None = None, jpeg_restart: bool = True
    ) -> None:
        self.root = root
        self.decode_check = decode_check
        if jpeg_restart and not restart_supported():
            warnings.warn(
                f"{root}: JPEGs are stored without restart markers: fastload.vision._jpegwin is not built (it "
                "needs libjpeg-turbo's headers at install time, e.g. Debian's libjpeg62-turbo-dev)",
                stacklevel=2,
            )
            jpeg_restart = False
        self.jpeg_restart = jpeg_restart
        if labels is None:
            labels = next((p for p in (os.path.join(root, n) for n in LABEL_FILES) if os.path.isfile(p)), None)
        self.labels_file = labels
        self.classes: list[str] | None
        if labels is not None:
            self.files, self.classes = labelled_images(root, labels)
        else:
            self.files, self.classes = self._from_subfolders(root)
        if not self.files:
            raise FormatError(f"{root}: no images found (expected {root}/<class>/<image>.jpg or a labels file)")
        self.schema = Schema((Field("image", "image"), Field("label", "scalar", np.dtype(np.int64))))

    @staticmethod
    def _from_subfolders(root: str) -> tuple[list[tuple[str, int]], list[str]]:
        classes = sorted(e for e in os.listdir(root) if os.path.isdir(os.path.join(root, e)))
        files: list[tuple[str, int]] = []
        for label, cls in enumerate(classes):
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls)):
                dirnames.sort()
                files += [(os.path.join(dirpath, f), label) for f in sorted(filenames) if is_image(f)]
        loose = sorted(e for e in os.listdir(root) if is_image(e) and os.path.isfile(os.path.join(root, e)))
        if not classes and loose:
            files, classes = [(os.path.join(root, f), 0) for f in loose], [""]
        if len(classes) == 1 and files:
            warnings.warn(
                f"{root}: no class subfolders to tell labels apart, so every label is 0; pass a labels file "
                f"(--labels FILE: CSV rows file,label or a JSON object) or use {root}/<class>/<image>",
                stacklevel=3,
            )
        return files, classes

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.files[i]
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise SchemaError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        if self.decode_check:
            check_image(data, path)
        else:
            image_size(data, path)  # the header at least: its size goes into meta.bin
        if self.jpeg_restart:
            data = add_restart_index(data)
        return {"image": data, "label": label}

    def describe(self, i: int) -> str:
        """The file sample `i` comes from (for error reports)."""
        return self.files[i][0]


def is_image(name: str) -> bool:
    """Whether a file name is an image by its extension (hidden files are not)."""
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _read_labels(path: str) -> dict[str, Any]:
    """{relative file: label} from a CSV (``file,label`` rows, an optional header) or a JSON object."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            if path.lower().endswith(".json"):
                table = json.load(fh)
                if not isinstance(table, dict):
                    raise FormatError(f"{path}: expected a JSON object mapping file -> label")
                return table
            rows = [r for r in csv.reader(fh) if r]
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: cannot read the labels file ({exc})") from exc
    if rows and rows[0][0].strip().lower() in ("file", "filename", "path", "image"):
        rows = rows[1:]
    bad = [i for i, r in enumerate(rows) if len(r) != 2]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FormatError(f"{path}: row {bad[0] + 1} is {rows[bad[0]]!r}, expected file,label{more}")
    return {r[0].strip(): r[1].strip() for r in rows}


def _relative(name: str) -> str:
    name = name.replace("\\", "/")
    return name[2:] if name.startswith("./") else name


def labelled_images(root: str, labels: str) -> tuple[list[tuple[str, int]], list[str] | None]:
    """(files with labels, class names or None) from the labels file `labels` for the images under
    `root`; every image needs a label and every label an image (errors name the first of each kind)."""
    table = _read_labels(labels)
    found = {
        os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
        for d, _, fs in os.walk(root)
        for f in fs
        if is_image(f)
    }
    listed = {_relative(k): v for k, v in table.items()}
    odd = [k for k, v in listed.items() if not isinstance(v, (str, int)) or isinstance(v, bool)]
    if odd:
        raise FormatError(f"{labels}: the label of {odd[0]} is {listed[odd[0]]!r}; labels are strings or integers")
    for what, names in (("lists files that are not images under " + root, sorted(set(listed) - found)),
                        ("has no label for images under " + root, sorted(found - set(listed)))):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise FormatError(f"{labels} {what}: {names[0]}{more}")
    values = [listed[k] for k in sorted(listed)]
    if all(isinstance(v, int) or v.lstrip("-").isdigit() for v in values):
        return [(os.path.join(root, k), int(listed[k])) for k in sorted(listed)], None
    classes = sorted({str(v) for v in values})
    index = {c: i for i, c in enumerate(classes)}
    return [(os.path.join(root, k), index[str(listed[k])]) for k in sorted(listed)], classes
