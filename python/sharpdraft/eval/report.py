"""The one writer of reports: every evaluation and benchmark writes its <name>.json,
<name>.md and <name>.png through here.

Files are written atomically: to a hidden temporary sibling first, then `os.replace`d over
the final name, so a reader (or an interrupted run) never sees half a report. matplotlib is
imported only inside `figure` (Agg backend, no display), so it is needed only when a plot is
made.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

Text = Union[str, Sequence[str]]


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def write_text(path, text: Text) -> Path:
    """Write `text` (a string, or lines joined with newlines plus a final one) to `path`
    atomically, creating its folder; returns the path."""
    path = Path(path)
    if not isinstance(text, str):
        text = "\n".join(text) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(path)
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json(path, data: Any, *, indent: Optional[int] = 2,
               default: Optional[Callable[[Any], Any]] = None) -> Path:
    """Write `data` as JSON (`indent`; `default` for objects json cannot encode, e.g. str) and
    a final newline to `path` atomically; returns the path.

    Raises:
        TypeError: data holds an object json cannot encode and no `default` is given.
    """
    return write_text(path, json.dumps(data, indent=indent, default=default) + "\n")


def write_report(out_dir, name: str, data: Any = None, markdown: Optional[Text] = None, *,
                 indent: Optional[int] = 2, default: Optional[Callable[[Any], Any]] = None,
                 figure=None, dpi: int = 120) -> Path:
    """Write the report `name` to the folder `out_dir` (created): name.json from `data` (if not
    None; see `write_json`), name.md from `markdown` (a string or a list of lines; if not None)
    and name.png from a matplotlib `figure` (if given; saved and closed by `save_figure`).
    Returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if data is not None:
        write_json(out / f"{name}.json", data, indent=indent, default=default)
    if markdown is not None:
        write_text(out / f"{name}.md", markdown)
    if figure is not None:
        save_figure(figure, out / f"{name}.png", dpi=dpi)
    return out


def figure(nrows: int = 1, ncols: int = 1, **kwargs):
    """(fig, axes) of `matplotlib.pyplot.subplots(nrows, ncols, **kwargs)` on the Agg backend,
    matplotlib imported here.

    Raises:
        ModuleNotFoundError saying how to install it: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ModuleNotFoundError("plots need matplotlib: pip install matplotlib (the "
                                  "sharpdraft[plot] extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, **kwargs)


def save_figure(fig, path, *, dpi: int = 120, tight: bool = True) -> Path:
    """Save `fig` to `path` atomically (the format from its suffix; `tight`: tight_layout
    first) and close it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    tmp = _partial(path)
    try:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or None)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
