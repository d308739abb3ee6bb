"""Which models can be launched, and the id the server will report for each.

Only files that exist are offered: the embedded default model (when the package ships it) and every `*.tinyloop`
under `--models-dir`. The id a client must send is the one the server reports in /v1/models; the server derives it
in `tinyloop.server.app` as `--served-model-name`, else the model file's name without `.tinyloop` (and, with the
server's own `--models-dir`, each file's name the same way), so `served_id` applies that rule here.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

from ..modelfile.format import ARCH, _Extents
from ..server.config import DEFAULT_MODEL
from .errors import LaunchError


@dataclass(frozen=True)
class Model:
    name: str  # what the user types to pick it: the file's name without .tinyloop
    path: Path
    size: int  # bytes

    def describe(self) -> str:
        return f"{self.name}  ({human_size(self.size)})  {self.path}"


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def installed_models(models_dir: str | Path | None, default: Path = DEFAULT_MODEL) -> list[Model]:
    """The embedded default model first (if the file is there), then every `*.tinyloop` under `models_dir`, sorted
    by path. Raises LaunchError for a `models_dir` that is not a directory."""
    paths = [default] if default.is_file() else []
    if models_dir is not None:
        root = Path(models_dir).expanduser()
        if not root.is_dir():
            raise LaunchError(f"--models-dir {models_dir}: not a directory")
        paths += sorted(p for p in root.rglob("*.tinyloop") if p.is_file())
    seen: set[Path] = set()
    models = []
    for path in paths:
        real = path.resolve()
        if real not in seen:
            seen.add(real)
            models.append(Model(path.stem, real, real.stat().st_size))
    return models


def resolve_model(choice: str, installed: list[Model]) -> Model:
    """The model `choice` names: an installed model's name, or the path of an existing model file. A name two
    installed files share is refused (the path tells them apart); anything else is refused with the list."""
    named = [m for m in installed if m.name == choice]
    if len(named) == 1:
        return named[0]
    path = Path(choice).expanduser()
    if path.is_file():
        real = path.resolve()
        return next((m for m in installed if m.path == real), Model(real.stem, real, real.stat().st_size))
    listing = "\n".join(f"  {m.describe()}" for m in installed) or "  (none)"
    if named:
        raise LaunchError(f"{len(named)} installed models are named {choice!r}; give its path:\n{listing}")
    raise LaunchError(f"model {choice!r} is not installed. Installed models:\n{listing}")


def served_id(path: Path, served_model_name: str | None = None, server_models_dir: str | None = None) -> str:
    """The id the server reports for `path`, by the rule of `tinyloop.server.app`: `cfg.served_model_name or
    cfg.model_path.stem`; with the server's own --models-dir, the id `scan_catalog` gives the file. A model outside
    that directory would not be served at all (the server falls back to another), so it is refused."""
    if not server_models_dir:
        return served_model_name or path.stem
    from ..server.residency import CatalogError, scan_catalog

    try:
        catalog = scan_catalog(server_models_dir)
    except CatalogError as e:
        raise LaunchError(str(e)) from None
    found = next((name for name, p in catalog.items() if p.resolve() == path.resolve()), None)
    if found is None:
        raise LaunchError(f"{path} is not under the server's --models-dir {server_models_dir}: pick one of its models")
    return found


def context_length(path: Path) -> int | None:
    """The model's context length from its metadata, read without loading the weights or the vocabulary (gguf's
    reader takes seconds on the default model's 50k-token vocabulary); None if the file does not say."""
    key = f"{ARCH}.context_length".encode()
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Extents(buf)
            if buf[:4] != b"GGUF":
                return None
            c.skip(4, "the magic number")
            if c.uint(4, "the version") not in (2, 3):
                return None
            c.skip(8, "the tensor count")
            for _ in range(c.uint(8, "the metadata count")):
                n = c.uint(8, "a metadata key")
                name = bytes(buf[c.pos : c.pos + n])
                c.skip(n, "a metadata key")
                vtype = c.uint(4, "a value type")
                if name == key and vtype in (4, 5):  # uint32 / int32, as writers store it
                    return c.uint(4, "the context length")
                c.value(vtype, "a metadata value")
    except (OSError, ValueError):
        return None
    return None
