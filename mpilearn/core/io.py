"""Atomic file writes (temp file + fsync + rename) and append-only JSON lines."""
from __future__ import annotations

import json
import os
import tempfile


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


_UMASK = _umask()


class WriteError(OSError):
    """Writing an output file failed; names the file and the cause. The previous version of
    the file is untouched (the new one was never renamed over it)."""


def _atomic(path: str, write, mode: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path))
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; group members should read outputs
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, (OSError, RuntimeError)) and not isinstance(err, WriteError):
            raise WriteError(f"writing {path} failed: {_cause(err, folder)}") from err
        raise


def _cause(err: BaseException, folder: str) -> str:
    """The reason in words: torch reports a full disk as a stream-writer error."""
    import errno
    import shutil

    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return "no space left on device"
    try:
        if shutil.disk_usage(folder).free < (1 << 20):
            return "no space left on device"
    except OSError:
        pass
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def atomic_write_text(path: str, text: str) -> None:
    _atomic(path, lambda f: f.write(text), "w")


def atomic_write_bytes(path: str, write_fn) -> None:
    """``write_fn(fileobj)`` writes the content (e.g. ``lambda f: torch.save(obj, f)``)."""
    _atomic(path, write_fn, "wb")


def append_jsonl(path: str, record: dict) -> None:
    """One JSON line, flushed and fsynced: a crash never loses an earlier line."""
    append_jsonl_many(path, [record])


def append_jsonl_many(path: str, records: list) -> None:
    """Several JSON lines with one fsync (a group commit: an fsync costs milliseconds)."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(r, default=_jsonable) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str) -> list:
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a kill: everything before it is intact
    return out


def _jsonable(obj):
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:
        pass
    return str(obj)
