"""sha256 digests, the one implementation: of a stream of byte chunks, and of files' contents
read in chunks (the target's weights in a corpus manifest, a GGUF file's provenance, a
benchmark's drafter weights). Lowest layer: imports nothing of sharpdraft."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator, Sequence, Union

CHUNK = 1 << 22       # bytes read at a time


def sha256_chunks(chunks: Iterable[bytes]) -> str:
    """Hex sha256 of the concatenation of `chunks`."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _file_chunks(paths: Sequence[Union[str, Path]], chunk: int) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                yield block


def sha256_files(*paths: Union[str, Path], chunk: int = CHUNK) -> str:
    """Hex sha256 of the files' contents, concatenated in the order given (one file: its own
    sha256, as `sha256sum` prints it).

    Raises:
        OSError: a file that cannot be read (FileNotFoundError when it does not exist).
    """
    return sha256_chunks(_file_chunks(paths, chunk))
