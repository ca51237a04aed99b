"""Atomic output: every file and directory Flint writes appears whole or not at all.

- Files (:func:`atomic_text_file`, :func:`write_text_atomic`,
  :func:`write_bytes_atomic`) are written to an anonymous ``O_TMPFILE``
  inode in the target's directory (it vanishes if the process dies, even by
  SIGKILL), linked under a hidden temporary name when complete and renamed
  onto the target. Where ``O_TMPFILE`` is unsupported a named temporary file
  is used instead.
- Directories (:func:`atomic_output_dir`) are built as a hidden sibling
  ``.<name>.<random>.tmp`` and renamed into place when complete. An existing
  directory is swapped with the new one in one ``renameat2(RENAME_EXCHANGE)``
  (readers see the old or the new directory, never a mix), then deleted.
  A small watcher process deletes the sibling if Flint is killed before it
  is renamed, so a SIGKILL leaves no debris.
- Modes follow the user's umask (0666/0777 minus umask), like any other tool.
- Problems (read-only location, a directory where a file should go, another
  file system) are :class:`~flint.errors.FlintError` naming the path;
  :func:`check_writable` reports them before expensive work starts.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from flint.errors import FlintError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _oserror(path: Path, e: OSError, what: str = "cannot write") -> FlintError:
    reason = e.strerror or str(e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason += " (the location is read-only for you; choose another output path)"
    return FlintError(f"{what} {path}: {reason}")


def check_writable(path: str | os.PathLike, *, is_dir: bool = False, force: bool = False) -> Path:
    """Fail early, with the path, if ``path`` cannot be written as a file (or a directory with ``is_dir``).

    The nearest existing ancestor must be a writable directory; an existing
    ``path`` must be of the right kind. Call it before capturing or
    simulating so a bad ``-o`` costs nothing.
    """
    p = Path(path).absolute()
    if p.name in ("", ".", ".."):
        raise FlintError(f"output path {path} names no file")
    if p.exists() or p.is_symlink():
        if is_dir and not p.is_dir():
            raise FlintError(f"{path} exists and is not a directory")
        if not is_dir and p.is_dir():
            raise FlintError(f"{path} is a directory; give a file name for the output")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise FlintError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FlintError(f"cannot write {path}: {parent} is not writable (choose another output path)")
    return p


# -- files ----------------------------------------------------------------------------

@contextmanager
def atomic_binary_file(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """Open an anonymous file in ``path``'s directory; link and rename it onto ``path`` when the block ends.

    If the block raises, nothing is left behind.
    """
    path = check_writable(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _oserror(path.parent, e, "cannot create directory") from None
    mode = 0o666 & ~_umask()
    fd = None
    named: str | None = None
    try:
        fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR, mode)
    except (OSError, AttributeError):
        try:
            fd, named = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.fchmod(fd, mode)
        except OSError as e:
            raise _oserror(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if named is None:
                named = _link_tmpfile(f.fileno(), path)
        os.replace(named, path)
        named = None
    except OSError as e:
        raise _oserror(path, e) from None
    finally:
        if named is not None and os.path.exists(named):
            os.unlink(named)


def _link_tmpfile(fd: int, path: Path) -> str:
    """Give an ``O_TMPFILE`` inode a hidden name beside ``path`` (it is renamed onto ``path`` at once).

    Where the kernel refuses the link (``/proc`` of a container on another
    device), the contents are copied to a named temporary file instead.
    """
    for _ in range(100):
        name = str(path.parent / f".{path.name}.{os.urandom(4).hex()}.tmp")
        try:
            os.link(f"/proc/self/fd/{fd}", name, follow_symlinks=True)
            return name
        except FileExistsError:
            continue
        except OSError:
            break
    out_fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(out_fd, os.fstat(fd).st_mode & 0o777)
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size:
            sent = os.sendfile(out_fd, fd, offset, size - offset)
            if sent == 0:
                break
            offset += sent
    except BaseException:
        os.close(out_fd)
        os.unlink(name)
        raise
    os.close(out_fd)
    return name


@contextmanager
def atomic_text_file(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[str]]:
    """Text-mode :func:`atomic_binary_file` (UTF-8); ``mode="wb"`` yields the binary file itself."""
    import io

    if mode == "wb":
        with atomic_binary_file(path) as raw:
            yield raw
        return
    with atomic_binary_file(path) as raw:
        f = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
        try:
            yield f
            f.flush()
        finally:
            f.detach()


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see the module docstring)."""
    with atomic_text_file(path) as f:
        f.write(text)
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_binary_file(path) as f:
        f.write(data)
    return Path(path)


# -- directories ----------------------------------------------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False when the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


_WATCHER = ("import shutil, sys\n"
            "sys.stdin.buffer.read()\n"
            "shutil.rmtree(sys.argv[1], ignore_errors=True)\n")


def _start_watcher(tmp: Path) -> subprocess.Popen | None:
    """A process that deletes ``tmp`` once this process exits (normally or killed): its stdin closes."""
    try:
        return subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(tmp)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                start_new_session=True)
    except OSError:
        return None


def _stop_watcher(w: subprocess.Popen | None) -> None:
    if w is not None:
        w.stdin.close()
        w.wait()


@contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, may_replace=None, force: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory; when the block succeeds it becomes ``out_dir``.

    An existing ``out_dir`` is replaced as a whole (old or new, never a mix)
    when it is empty, when ``may_replace(names)`` accepts its file names
    (e.g. the files of the trace being rewritten), or with ``force``;
    otherwise a :class:`FlintError` says why before any work. When
    ``out_dir`` is a mount point (it cannot be renamed), the staging
    directory is made inside it and the files are moved in one by one.
    """
    out = check_writable(out_dir, is_dir=True)
    if out.is_symlink():
        out = out.resolve()
    if out.is_dir():
        names = sorted(os.listdir(out))
        if names and not force and not (may_replace is not None and may_replace(names)):
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise FlintError(f"output directory {out_dir} exists and holds other files ({shown}); "
                             "it would be replaced as a whole: pass --force, or choose another directory")
    mounted = out.is_dir() and os.path.ismount(out)
    stage_parent = out if mounted else out.parent
    try:
        stage_parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=stage_parent))
        os.chmod(tmp, 0o777 & ~_umask())
    except OSError as e:
        raise _oserror(out, e) from None
    watcher = _start_watcher(tmp)
    try:
        yield tmp
        _commit_dir(tmp, out, mounted)
    except OSError as e:
        raise _oserror(out, e) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        _stop_watcher(watcher)


def _commit_dir(tmp: Path, out: Path, mounted: bool) -> None:
    if mounted:
        for name in os.listdir(out):
            p = out / name
            if p != tmp and name not in os.listdir(tmp):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        for name in sorted(os.listdir(tmp)):
            os.replace(tmp / name, out / name)
        return
    if not out.exists():
        os.rename(tmp, out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp)  # now the old directory
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.rename(out, old / "d")
    os.rename(tmp, out)
    shutil.rmtree(old)
