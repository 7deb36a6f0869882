"""The archive store: an S3-compatible bucket or a local directory, through one code path.

fsspec is the storage protocol (isdir, ls, rm, put, get, open) so the local-directory tier and
S3 share every line above this module; s3fs speaks S3 (multipart uploads for large files,
parallel parts). Every call is bounded: botocore's connect and read timeouts and a fixed number
of attempts, so an unreachable store fails with one clear line instead of hanging a drill.
"""

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
from fsspec.callbacks import Callback

from tasks.errors import CkptopsError
from tasks.storage.digest import FileHash, Hashing, combine
from tasks.storage.local import atomic_write, make_durable

READ_BLOCK = 8 << 20


class ArchiveUnavailable(CkptopsError):
    """The archive could not be reached or refused an operation (after the bounded retries)."""


class AccessDenied(ArchiveUnavailable):
    """The store refused this one object (permissions), while it answers otherwise."""


class _Relay(Callback):
    """Passes fsspec's byte counts on to our progress callback."""

    def __init__(self, progress: Callable[[int], None] | None):
        super().__init__()
        self.progress = progress

    def relative_update(self, inc=1):
        if self.progress and inc:
            self.progress(inc)


def _write_local(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename, fsync of the directory: all or nothing, and durable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)


class ArchiveStore:
    """Keys are '/'-separated and relative to the archive's root (``job/iter_0000100/x``)."""

    def __init__(
        self, fs: fsspec.AbstractFileSystem, root: str, url: str, chunk_bytes: int, concurrency: int
    ):
        self.fs, self.root, self.url = fs, root.rstrip("/"), url.rstrip("/")
        self.is_local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self.chunk_bytes, self.concurrency = chunk_bytes, concurrency

    @classmethod
    def from_settings(cls, settings) -> "ArchiveStore":
        chunk = settings.multipart_chunk_mb << 20
        if settings.is_s3:
            import s3fs

            fs = s3fs.S3FileSystem(
                endpoint_url=settings.endpoint_url,
                profile=settings.aws_profile,
                client_kwargs={"region_name": settings.region} if settings.region else {},
                config_kwargs={
                    "connect_timeout": settings.connect_timeout_seconds,
                    "read_timeout": settings.read_timeout_seconds,
                    "retries": {"max_attempts": settings.max_attempts, "mode": "standard"},
                },
                max_concurrency=settings.max_concurrency,
                skip_instance_cache=True,
                # Another process may commit at any time: never answer from a stale listing.
                use_listings_cache=False,
            )
            fs.retries = settings.max_attempts  # s3fs's own retry loop, on top of botocore's
            root = settings.url.removeprefix("s3://")
        else:
            fs = fsspec.filesystem("file", auto_mkdir=True)
            root = str(Path(settings.url).resolve())
        return cls(fs, root, settings.url, chunk, settings.max_concurrency)

    def where(self, key: str) -> str:
        """The human-readable location of a key, for messages."""
        return f"{self.url}/{key}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _call(self, what: str, key: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except PermissionError as e:  # one object refused (s3fs: AccessDenied): not an outage
            raise AccessDenied(f"{self.where(key)}: {what} refused ({e})") from None
        except CkptopsError:
            raise
        except Exception as e:  # botocore, aiohttp and OS errors all mean the same here
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ArchiveUnavailable(
                f"{self.where(key)}: {what} failed ({type(e).__name__}: {detail})"
            ) from None

    def exists(self, key: str) -> bool:
        return self._call("exists", key, self.fs.exists, self._path(key))

    def size(self, key: str) -> int | None:
        try:
            return self._call("stat", key, self.fs.size, self._path(key))
        except FileNotFoundError:
            return None

    def listdir(self, key: str) -> list[str]:
        """Names directly under ``key`` (empty if there is nothing)."""
        try:
            entries = self._call("list", key, self.fs.ls, self._path(key), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def sizes(self, key: str) -> dict[str, int]:
        """Names directly under ``key`` with their sizes, from one listing (nothing is read)."""
        try:
            entries = self._call("list", key, self.fs.ls, self._path(key), detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries
            if e.get("type") != "directory"
        }

    def read(self, key: str) -> bytes:
        return self._call("read", key, self.fs.cat_file, self._path(key))

    def write(self, key: str, data: bytes) -> None:
        """A small object, all or nothing: an S3 PUT is atomic; on a directory it is written to a
        temporary name and renamed, as a manifest (the commit marker) must never be half there."""
        path = self._path(key)
        if self.is_local:
            self._call("write", key, _write_local, Path(path), data)
        else:
            self._call("write", key, self.fs.pipe_file, path, data)

    def remove(self, key: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call("delete", key, self.fs.rm, self._path(key), recursive=recursive)

    def put_files(self, pairs: list[tuple[Path, str]], progress: Callable[[int], None] | None = None) -> None:
        """Upload files in parallel; s3fs uses multipart uploads above the chunk size."""

        def put(pair):
            local, key = pair
            self._call(
                "upload",
                key,
                self.fs.put_file,
                str(local),
                self._path(key),
                callback=_Relay(progress),
                chunksize=self.chunk_bytes,
            )

        self._parallel(put, pairs)
        if self.is_local and pairs:  # on disk, uploaded must mean on the disk before the commit
            self._call(
                "upload",
                pairs[0][1],
                make_durable,
                [Path(self._path(key)) for _, key in pairs],
                Path(self.root),
            )

    def get_files(self, pairs: list[tuple[str, Path]], progress: Callable[[int], None] | None = None) -> None:
        def get(pair):
            key, local = pair
            self._call(
                "download", key, self.fs.get_file, self._path(key), str(local), callback=_Relay(progress)
            )

        self._parallel(get, pairs)

    def hash_object(
        self, key: str, hashing: Hashing, progress: Callable[[int], None] | None = None
    ) -> tuple[int, str]:
        """Read an object back and hash it the way its manifest does (size and ``hashing``)."""

        def read_back():
            hasher = FileHash(hashing)
            with self.fs.open(self._path(key), "rb", block_size=READ_BLOCK) as f:
                while chunk := f.read(READ_BLOCK):
                    hasher.update(chunk)
                    if progress:
                        progress(len(chunk))
            return hasher.position, combine(hasher.finish(), hashing.algorithm)

        return self._call("read-back", key, read_back)

    def hash_objects(
        self,
        keys: list[str],
        hashing: Hashing,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, tuple[int, str] | None]:
        """Read back many objects in parallel; None for an object that is not there."""

        def one(key):
            try:
                return key, self.hash_object(key, hashing, progress)
            except FileNotFoundError:
                return key, None

        return dict(self._parallel(one, keys))

    def _parallel(self, fn, items):
        with ThreadPoolExecutor(
            max_workers=max(1, min(self.concurrency, len(items) or 1, os.cpu_count() * 4))
        ) as pool:
            return list(pool.map(fn, items))
