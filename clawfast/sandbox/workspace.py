"""The host's side of a workspace: files written into it and read back from it, never through a link.

A sandbox can plant symbolic links in its workspace between two commands: `write_files` refuses to
write through one and `read_file` / `read_head` / `read_tree` never follow one, so the host neither
writes nor reads outside the workspace on a sandbox's behalf.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Mapping

from clawfast.sandbox.spec import check_relative_path


def write_files(root: str, files: Mapping[str, bytes | str]) -> None:
    """Write `files` under `root`, refusing to follow symlinks the sandbox may have planted."""
    for rel, content in files.items():
        p = check_relative_path(rel)
        parent = root
        for part in p.parts[:-1]:
            parent = os.path.join(parent, part)
            if os.path.islink(parent):
                raise ValueError(f"cannot write {rel!r}: {part!r} is a symbolic link")
            os.makedirs(parent, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        fd = os.open(os.path.join(root, *p.parts), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def populate(root: str, source_dir: str | None, files: Mapping[str, bytes | str]) -> None:
    os.makedirs(root, exist_ok=True)
    if source_dir is not None:
        shutil.copytree(source_dir, root, symlinks=True, dirs_exist_ok=True)
    write_files(root, files)


def _open_regular(root: str, path: str) -> int:
    """A read-only descriptor of the regular file `path` under `root`, opened without following any
    symlink (FileNotFoundError if absent, ValueError if it is not a regular file or a component is a
    link)."""
    p = check_relative_path(path)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in p.parts[:-1]:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            except OSError as exc:
                # Linux answers ENOTDIR (or ELOOP) for a link opened with O_DIRECTORY | O_NOFOLLOW.
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    is_link = stat.S_ISLNK(os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode)
                    what = "a symbolic link" if is_link else "not a directory"
                    raise ValueError(f"{path!r}: {part!r} is {what}") from None
                raise
            os.close(dir_fd)
            dir_fd = nxt
        try:
            fd = os.open(p.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"{path!r} is a symbolic link") from None
            raise
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path!r} is not a regular file")
    return fd


def read_file(root: str, path: str) -> bytes:
    """Read one regular file under `root` without following any symlink (FileNotFoundError if absent,
    ValueError if it is not a regular file or a component is a link)."""
    with os.fdopen(_open_regular(root, path), "rb") as f:
        return f.read()


def read_head(root: str, path: str, max_bytes: int) -> tuple[bytes, int]:
    """The first `max_bytes` bytes of a regular file under `root` and its size, read as `read_file`
    reads (no symlink followed, the same errors)."""
    with os.fdopen(_open_regular(root, path), "rb") as f:
        return f.read(max_bytes), os.fstat(f.fileno()).st_size


def read_tree(root: str, max_total_bytes: int) -> dict[str, bytes]:
    """Every regular file under `root` (symlinks and special files skipped), relative path -> bytes."""
    out: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                continue
            total += st.st_size
            if total > max_total_bytes:
                raise ValueError(f"workspace holds more than {max_total_bytes} bytes; read files by path")
            rel = os.path.relpath(full, root)
            out[rel] = read_file(root, rel)
    return out
