"""The archive root on any pyarrow filesystem: a local directory, a `file://` URI, a
shared mount, or a remote store (`s3://`, `gs://`, `hdfs://`), so a Spark cluster
elsewhere can read what the nodes write.

Every write goes through pyarrow's filesystem API (write under a hidden name, then
move into place), so local and remote roots take the same path through the code.
When the root is on the local disk (a `LocalFileSystem`, or a `SubTreeFileSystem`
over one) the store also fsyncs files and directories and takes `flock` locks; a
remote store is as durable as the store says a closed object is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sevendb.cluster.archive.format import ArchiveError
from sevendb.cluster.common.files import fsync_dir


class ArchiveConfigError(ArchiveError, ValueError):
    """A bad writer setting or root; the message names it and says what is allowed."""


def _local_dir(fs: pafs.FileSystem, base: str) -> Path | None:
    """The POSIX path of `base` in `fs` when `fs` is the local disk, else None."""
    if isinstance(fs, pafs.LocalFileSystem):
        return Path(base)
    if isinstance(fs, pafs.SubTreeFileSystem):
        inner = _local_dir(fs.base_fs, fs.base_path.rstrip("/") or "/")
        return None if inner is None else inner / base
    return None


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArchiveStore:
    """Paths relative to the archive root ('/'-separated) on one pyarrow filesystem."""

    def __init__(self, filesystem: pafs.FileSystem, base: str) -> None:
        self.fs = filesystem
        self.base = base
        #: The root's POSIX path when it is on the local disk (fsync and flock apply).
        self.local = _local_dir(filesystem, base)

    @classmethod
    def open(
        cls, root: str | Path, filesystem: pafs.FileSystem | None = None, *, create: bool = True
    ) -> ArchiveStore:
        """`root` is a local path or a URI pyarrow knows (`file:///...`, `s3://...`), or
        a path inside `filesystem` when one is given. The root directory is created
        (with `create`), else it must exist."""
        text = str(root)
        if filesystem is not None:
            fs, base = filesystem, text.rstrip("/")
            if isinstance(fs, pafs.LocalFileSystem):
                base = str(Path(base).expanduser().resolve())
        elif "://" in text or text.startswith("file:"):
            try:
                fs, base = pafs.FileSystem.from_uri(text)
            except (ValueError, pa.ArrowException, OSError) as exc:
                raise ArchiveConfigError(
                    f"archive root {text!r} is not a usable URI: {exc}"
                ) from None
            if isinstance(fs, pafs.LocalFileSystem):
                base = str(Path(base).resolve())
        else:
            fs, base = pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())
        store = cls(fs, base.rstrip("/") if base != "/" else base)
        kind = store.info("").type
        if kind not in (pafs.FileType.Directory, pafs.FileType.NotFound):
            raise ArchiveConfigError(
                f"archive root {store.describe()} exists and is not a directory"
            )
        if not create:
            if kind == pafs.FileType.NotFound:
                raise ArchiveError(f"archive root {store.describe()} is not a directory")
            return store
        try:
            store.make_dirs("")
        except OSError as exc:
            raise ArchiveConfigError(
                f"cannot create archive root {store.describe()}: {exc}"
            ) from exc
        return store

    def describe(self, rel: str = "") -> str:
        """A path for messages: the local path, or `<filesystem>:<path>`."""
        if self.local is not None:
            return str(self.local / rel) if rel else str(self.local)
        return f"{self.fs.type_name}:{self.path(rel)}"

    def path(self, rel: str) -> str:
        """`rel` as a path of the filesystem."""
        if not rel:
            return self.base
        return f"{self.base}/{rel}" if self.base else rel

    def info(self, rel: str) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path(rel))

    def exists(self, rel: str) -> bool:
        return self.info(rel).type != pafs.FileType.NotFound

    def files(self, rel: str = "", *, recursive: bool = True) -> list[pafs.FileInfo]:
        """Every file under `rel` (none if it does not exist), paths made relative."""
        selector = pafs.FileSelector(self.path(rel), recursive=recursive, allow_not_found=True)
        prefix = f"{self.base}/" if self.base else ""
        out = []
        for info in self.fs.get_file_info(selector):
            if info.type == pafs.FileType.File:
                path = info.path[len(prefix) :] if info.path.startswith(prefix) else info.path
                out.append(
                    pafs.FileInfo(
                        path.lstrip("/"), info.type, size=info.size, mtime_ns=info.mtime_ns
                    )
                )
        return out

    # -- writing -------------------------------------------------------------------

    def make_dirs(self, rel: str) -> None:
        """Create `rel` and its parents; on the local disk each new directory's entry
        is fsynced into its parent."""
        if self.local is None:
            self.fs.create_dir(self.path(rel), recursive=True)
            return
        missing: list[Path] = []
        d = self.local / rel if rel else self.local
        while not d.is_dir():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            d.mkdir(exist_ok=True)
            fsync_dir(d.parent)

    def sync(self, rel: str) -> None:
        """Make a written file durable (local disk only; a closed remote object is)."""
        if self.local is not None:
            _fsync_file(self.local / rel)

    def move(self, src: str, dst: str) -> None:
        """Rename `src` to `dst` (replacing it) and make the rename durable."""
        self.fs.move(self.path(src), self.path(dst))
        if self.local is not None:
            fsync_dir((self.local / dst).parent)
            if (self.local / src).parent != (self.local / dst).parent:
                fsync_dir((self.local / src).parent)

    def delete(self, rel: str) -> bool:
        """Delete a file (durably on the local disk); False if it was not there."""
        try:
            self.fs.delete_file(self.path(rel))
        except FileNotFoundError:
            return False
        if self.local is not None:
            fsync_dir((self.local / rel).parent)
        return True

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data` so a reader or a crash sees the old or the new
        content, never a mix: written under a hidden name, synced, moved into place."""
        parent, _, name = rel.rpartition("/")
        tmp = f"{parent}/.{name}.tmp" if parent else f".{name}.tmp"
        with self.fs.open_output_stream(self.path(tmp)) as out:
            out.write(data)
        self.sync(tmp)
        self.move(tmp, rel)

    def write_table(self, rel: str, table: pa.Table, compression: str | None) -> int:
        """Write a Parquet file, sync it; returns its size in bytes."""
        pq.write_table(table, self.path(rel), filesystem=self.fs, compression=compression)
        self.sync(rel)
        size = self.info(rel).size
        return int(size or 0)

    def parquet_writer(
        self, rel: str, schema: pa.Schema, compression: str | None
    ) -> pq.ParquetWriter:
        """A streaming Parquet writer for `rel` (the caller syncs it after closing)."""
        return pq.ParquetWriter(self.path(rel), schema, filesystem=self.fs, compression=compression)

    # -- reading -------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's content, or None if it does not exist."""
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                data: bytes = f.read()
                return data
        except FileNotFoundError:
            return None

    def read_metadata(self, rel: str) -> dict[bytes, bytes] | None:
        """A Parquet file's footer key-value metadata."""
        return pq.read_schema(self.path(rel), filesystem=self.fs).metadata

    def column_max(self, rel: str, column: str) -> int | None:
        """The largest value of an integer column, from the footer's statistics (None
        when a row group has none)."""
        meta = pq.read_metadata(self.path(rel), filesystem=self.fs)
        best: int | None = None
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                chunk = group.column(c)
                if chunk.path_in_schema != column:
                    continue
                stats = chunk.statistics
                if stats is None or not stats.has_min_max:
                    return None
                best = int(stats.max) if best is None else max(best, int(stats.max))
        return best

    def read_table(self, rel: str, schema: pa.Schema) -> pa.Table:
        return pq.read_table(self.path(rel), filesystem=self.fs, schema=schema)

    def batches(self, rel: str, rows: int) -> Iterator[pa.RecordBatch]:
        """A Parquet file's rows, at most `rows` at a time: what reading it holds is a
        batch, not the file."""
        with self.fs.open_input_file(self.path(rel)) as source:
            yield from pq.ParquetFile(source).iter_batches(batch_size=rows)

    # -- locking -------------------------------------------------------------------

    @contextlib.contextmanager
    def held(self, rel: str, what: str) -> Iterator[None]:
        """Hold an exclusive `flock` on `rel` (local disk) for the body's duration; on a
        remote store there is no lock (docs/spark.md: one writer per node id)."""
        if self.local is None:
            yield
            return
        path = self.local / rel
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise ArchiveError(f"another {what} holds {path}") from exc
                raise
            yield
        finally:
            os.close(fd)


__all__ = ["ArchiveConfigError", "ArchiveStore"]
