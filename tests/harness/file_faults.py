"""What the file tests do to files: flip bytes inside a tensor stored in a checkpoint, and give
a directory a file system that fills up (a tmpfs of a few pages, where root may mount one)."""
from __future__ import annotations

import contextlib
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest


def flip_bytes_in_a_tensor(path: Path, count: int = 8) -> None:
    """Inverts ``count`` bytes in the middle of the first tensor storage of the checkpoint
    at ``path`` (the zip member ``*/data/0``): the archive stays well-formed, and torch.load,
    which checks no CRC, would load it."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    data = bytearray(path.read_bytes())
    name_bytes, extra_bytes = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_bytes + extra_bytes
    assert info.file_size >= 2 * count, "the tensor is too small to flip inside"
    at = start + info.file_size // 2 - count // 2
    data[at:at + count] = bytes(b ^ 0xFF for b in data[at:at + count])
    path.write_bytes(bytes(data))


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str = "64k"):
    """Mounts a tmpfs of ``size`` at ``directory`` (created, mode 0700) for the block, and
    unmounts it after; skips the test, with the reason, where mounting is not permitted."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(directory)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root): "
                    f"{proc.stderr.strip() or proc.returncode}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)
