"""Byte-level corpus: the running interpreter's own standard-library ``.py`` sources.

Every Python installation has them, so the demo needs no download. Files are listed in sorted
order and split by a CRC32 of their path relative to the stdlib folder (deterministic across
machines with the same Python); each file's bytes are followed by ``EOF_TOKEN``. Tokens are the
bytes 0-255 plus ``EOF_TOKEN`` (256); the model's vocabulary is padded to ``VOCAB`` (272).
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

EOF_TOKEN = 256
VOCAB = 272  # 256 bytes + end of file, padded to a multiple of 16
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files under the stdlib folder (``sysconfig.get_paths()["stdlib"]``), no site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))


def load_split(train_bytes: int, val_bytes: int, val_every: int = 20,
               root: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` int64 token streams of at most ``train_bytes`` / ``val_bytes`` tokens.

    A file goes to validation when ``crc32(relative path) % val_every == 0``. Files are taken in
    sorted order until both streams are full, so the same sizes give the same data.
    """
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    limit = {False: train_bytes, True: val_bytes}
    for path in stdlib_files(root):
        val = zlib.crc32(path.relative_to(root).as_posix().encode()) % val_every == 0
        if sizes[val] >= limit[val]:
            if sizes[not val] >= limit[not val]:
                break
            continue
        data = path.read_bytes()
        if not data:
            continue
        parts[val].append(data)
        sizes[val] += len(data) + 1
    if not parts[False] or not parts[True]:
        raise ValueError(f"root: found too few .py files under {root} for a train/validation split")
    return _stream(parts[False], train_bytes), _stream(parts[True], val_bytes)


def _stream(files: list[bytes], max_bytes: int) -> torch.Tensor:
    out = []
    for data in files:
        out.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
        out.append(torch.tensor([EOF_TOKEN]))
    return torch.cat(out)[:max_bytes]


def batches(stream: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless ``(batch, seq + 1)`` windows at random offsets of ``stream`` (inputs + shifted targets)."""
    if stream.numel() <= seq + 1:
        raise ValueError(f"seq: expected < {stream.numel() - 1} (the token stream's length), got {seq}")
    g = torch.Generator().manual_seed(seed)
    span = torch.arange(seq + 1)
    while True:
        starts = torch.randint(0, stream.numel() - seq - 1, (batch, 1), generator=g)
        yield stream[starts + span]


def decode(tokens: list[int]) -> str:
    """Bytes back to text (``EOF_TOKEN`` and padding ids shown as a newline)."""
    return bytes(t if t < 256 else 10 for t in tokens).decode("utf-8", errors="replace")
