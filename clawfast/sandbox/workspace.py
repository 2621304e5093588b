"""The host's side of a workspace: files written into it and read back from it, never through a link.

A sandbox can plant symbolic links in its workspace, between two commands or while one runs:
`write_files` never writes through one (it walks by directory descriptors, so a directory swapped for a
link meanwhile is caught too) and `read_file` / `read_head` / `read_tree` never follow one, so the host
neither writes nor reads outside the workspace on a sandbox's behalf. A FIFO or other special file in
a file's place is refused without blocking, and reads are bounded by the files' sizes (`max_bytes`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import PurePosixPath

from clawfast.sandbox.spec import check_relative_path


def write_files(root: str, files: Mapping[str, bytes | str]) -> None:
    """Write `files` under `root` without following any symlink (ValueError if a component is a link
    or not a directory, or the file itself is a link or not a regular file).

    A command may run meanwhile and swap a directory for a link: the walk goes by directory
    descriptors, each component opened (or made) relative to its parent with O_NOFOLLOW, so no path
    is resolved twice. The file is opened with O_NONBLOCK, so that a FIFO planted in its place cannot
    block the host (it is refused by fstat)."""
    for rel, content in files.items():
        p = check_relative_path(rel)
        data = content.encode() if isinstance(content, str) else content
        dir_fd = _open_parent(root, p, rel, make=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(p.parts[-1], flags, 0o644, dir_fd=dir_fd)
            except OSError as exc:
                # ELOOP: a link; ENXIO: a FIFO nobody reads or a socket; EISDIR: a directory.
                if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise ValueError(f"cannot write {rel!r}: it exists and is not a regular file") from None
                raise
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"cannot write {rel!r}: it exists and is not a regular file")
            os.set_blocking(fd, True)
            # Truncated only now that it is known to be a regular file.
            f.truncate(0)
            f.write(data)


def copy_sparse(src: str, dst: str) -> str:
    """`shutil.copy2` of a regular file that keeps its holes (`copy_function` of the workspace copies):
    a sparse file costs a sandbox's tmpfs nothing, and written out whole by each copy of the workspace
    (`truncate -s 1G f{1..1000}`) it would have the host write a terabyte. Data runs are found with
    SEEK_DATA / SEEK_HOLE (a filesystem without them reports the whole file as data). Anything but a
    regular file is refused as `shutil.copyfile` refuses it (`shutil.SpecialFileError`), never opened."""
    if not stat.S_ISREG(os.stat(src).st_mode):
        raise shutil.SpecialFileError(f"`{src}` is not a regular file")
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fd, size, pos = fin.fileno(), os.fstat(fin.fileno()).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole past `pos`
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            fin.seek(start)
            fout.seek(start)
            while start < end:
                chunk = fin.read(min(end - start, 1 << 20))
                if not chunk:
                    break
                fout.write(chunk)
                start += len(chunk)
            pos = end
        fout.truncate(size)
    shutil.copystat(src, dst)
    return dst


def copy_workspace(src: str | os.PathLike, dst: str | os.PathLike, *, ignore=None, dirs_exist_ok: bool = False) -> None:
    """`shutil.copytree` of a tree an agent left: links copied as links (never followed), holes kept
    (`copy_sparse`), and a file with several hard links written once and linked again in the copy: the
    agent's disk quota counts it once, and written out per link (``ln f l{1..200}`` of a 20 MiB file)
    each copy of the workspace had the host write 4 GiB. `ignore` as copytree's."""
    written: dict[tuple[int, int], str] = {}

    def copy(source: str, target: str) -> str:
        st = os.lstat(source)
        if st.st_nlink > 1 and stat.S_ISREG(st.st_mode):
            first = written.get((st.st_dev, st.st_ino))
            if first is not None:
                os.link(first, target)
                return target
            written[(st.st_dev, st.st_ino)] = target
        return copy_sparse(source, target)

    shutil.copytree(src, dst, symlinks=True, ignore=ignore, dirs_exist_ok=dirs_exist_ok, copy_function=copy)


def populate(root: str, source_dir: str | None, files: Mapping[str, bytes | str]) -> None:
    os.makedirs(root, exist_ok=True)
    if source_dir is not None:
        copy_workspace(source_dir, root, dirs_exist_ok=True)
    write_files(root, files)


def _open_dir(dir_fd: int, part: str, path: str, *, make: bool = False) -> int:
    """The directory `part` of `dir_fd`, opened without following a link (ValueError naming `path`
    when it is a link or not a directory); `make`: made first (mode 755) where nothing is there."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(part, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            if not make:
                raise
            os.mkdir(part, 0o755, dir_fd=dir_fd)
            return os.open(part, flags, dir_fd=dir_fd)
    except OSError as exc:
        # Linux answers ENOTDIR (or ELOOP) for a link opened with O_DIRECTORY | O_NOFOLLOW.
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            is_link = stat.S_ISLNK(os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            what = "a symbolic link" if is_link else "not a directory"
            raise ValueError(f"{path!r}: {part!r} is {what}") from None
        raise


def _open_parent(root: str, p: PurePosixPath, path: str, *, make: bool = False) -> int:
    """A descriptor of the directory holding `p` under `root`, walked to component by component
    relative to its parent (`_open_dir`), so that no path is resolved twice and no link is followed;
    `make`: missing directories are made on the way."""
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in p.parts[:-1]:
            nxt = _open_dir(dir_fd, part, path, make=make)
            os.close(dir_fd)
            dir_fd = nxt
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _open_regular(root: str, path: str) -> int:
    """A read-only descriptor of the regular file `path` under `root`, opened without following any
    symlink (FileNotFoundError if absent, ValueError if it is not a regular file or a component is a
    link)."""
    p = check_relative_path(path)
    dir_fd = _open_parent(root, p, path)
    try:
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


def read_file(root: str, path: str, max_bytes: int | None = None) -> bytes:
    """Read one regular file under `root` without following any symlink (FileNotFoundError if absent,
    ValueError if it is not a regular file, a component is a link, or it holds more than `max_bytes`).
    The size is judged by fstat before reading (a sparse file costs its sandbox nothing and the host
    its full size) and again by what is read (the file may grow meanwhile)."""
    with os.fdopen(_open_regular(root, path), "rb") as f:
        if max_bytes is None:
            return f.read()
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            raise ValueError(f"{path!r} holds more than {max_bytes} bytes")
        return data


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
            if total + st.st_size > max_total_bytes:
                raise ValueError(f"workspace holds more than {max_total_bytes} bytes; read files by path")
            rel = os.path.relpath(full, root)
            out[rel] = read_file(root, rel, max_total_bytes - total)
            total += len(out[rel])
    return out
