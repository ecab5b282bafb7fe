"""The error for a model file that is not what its name says: most often a Git LFS pointer, the small text
file a clone without git-lfs leaves in place of the weights or the tokenizer."""
from __future__ import annotations

LFS_POINTER = b"version https://git-lfs"       # how a Git LFS pointer file starts


def unreadable(path: str, what: str, error: Exception) -> ValueError:
    """ValueError naming `path`, that it is no readable `what`, and why: a Git LFS pointer (with the
    command that fetches the file), else the reader's own message (a cut download, a newer format)."""
    try:
        with open(path, "rb") as f:
            lfs = f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:
        lfs = False
    reason = "a Git LFS pointer, not the file: fetch it (git lfs pull)" if lfs else str(error) or type(error).__name__
    return ValueError(f"{path}: not a readable {what} ({reason})")
