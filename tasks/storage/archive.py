"""The archive store: an S3-compatible bucket or a local directory, through one code path.

fsspec is the storage protocol (isdir, ls, rm, put, get, open) so the local-directory tier and
S3 share every line above this module; s3fs speaks S3 (multipart uploads for large files,
parallel parts). Every call is bounded: botocore's connect and read timeouts and a fixed number
of attempts, so an unreachable store fails with one clear line instead of hanging a drill.

On S3 the data files go up through botocore directly (``put_checked``), as s3fs cannot send a
full-object checksum: one read of each source file both re-hashes it the way its manifest does
and computes the CRC64NVME the store keeps for the object (the same CRC botocore computes, from
awscrt), sent with the upload (a multipart upload is of checksum type FULL_OBJECT), so the store
refuses bytes that differ on arrival. ``head`` then reads the store's own checksum, size,
encryption and Object Lock back without a download.
"""

import base64
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
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


class SourceChanged(CkptopsError):
    """A source file no longer hashes as its manifest says: it is not archived."""


def crc64nvme_b64(crc: int) -> str:
    """The form S3 keeps a CRC64NVME in (``ChecksumCRC64NVME``): 8 big-endian bytes, base64."""
    return base64.b64encode(crc.to_bytes(8, "big")).decode()


def _crc64nvme(data, previous: int = 0) -> int:
    from awscrt.checksums import crc64nvme  # what botocore itself uses for CRC64NVME

    return crc64nvme(data, previous)


@dataclass(frozen=True)
class Stored:
    """What the store says about one object (HeadObject with ChecksumMode=ENABLED)."""

    size: int
    crc64nvme: str | None
    checksum_type: str | None
    sse: str | None
    kms_key_id: str | None
    bucket_key: bool
    lock_mode: str | None
    retain_until: str | None


@dataclass(frozen=True)
class Sent:
    """One source file as it went up (or was found up already): its size, manifest hash and the
    CRC64NVME of the very bytes that were hashed."""

    size: int
    hash: str
    crc64nvme: str
    uploaded: bool


class _SourceRead:
    """One read of a source file, in order, that hashes it as its manifest does and computes its
    CRC64NVME on the way: what goes up is what was hashed."""

    def __init__(self, local: Path, hashing: Hashing):
        self.local, self.hashing = local, hashing
        self.hasher, self.crc = FileHash(hashing), 0

    def read(self, f, size: int = -1) -> bytes:
        data = f.read(size)
        self.hasher.update(data)
        self.crc = _crc64nvme(data, self.crc)
        return data

    def sent(self, uploaded: bool) -> Sent:
        digest = combine(self.hasher.finish(), self.hashing.algorithm)
        return Sent(self.hasher.position, digest, crc64nvme_b64(self.crc), uploaded)

    def check(self, want: tuple[int, str]) -> None:
        """Raises SourceChanged unless what was read is ``want`` (its manifest's size and hash)."""
        got = self.sent(uploaded=False)
        if (got.size, got.hash) != want:
            raise SourceChanged(
                f"{self.local}: reads {got.size} bytes, hash {got.hash}; its manifest says {want[0]} bytes, "
                f"hash {want[1]}: the source changed since it was verified; not archived"
            )


def checksum_file(local: Path, hashing: Hashing) -> Sent:
    """One read of a local file: its size, its manifest hash and its CRC64NVME (not uploaded)."""
    source = _SourceRead(local, hashing)
    with open(local, "rb") as f:
        while source.read(f, READ_BLOCK):
            pass
    return source.sent(uploaded=False)


class _PartsPool(ThreadPoolExecutor):
    """The multipart parts in flight, for all files: ``room`` bounds the parts read into memory
    and not yet uploaded (taken before a part is read, given back when it is up or failed)."""

    def __init__(self, concurrency: int):
        super().__init__(max_workers=concurrency)
        self.room = threading.BoundedSemaphore(concurrency)

    def submit(self, fn, *args):
        def run():
            try:
                return fn(*args)
            finally:
                self.room.release()

        return super().submit(run)


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
        self.settings = None
        self._client, self._client_lock = None, threading.Lock()

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
        store = cls(fs, root, settings.url, chunk, settings.max_concurrency)
        store.settings = settings
        return store

    @property
    def client(self):
        """A botocore S3 client with the same endpoint, credentials, timeouts and attempts as s3fs."""
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                st = self.settings
                session = boto3.session.Session(profile_name=st.aws_profile, region_name=st.region)
                self._client = session.client(
                    "s3",
                    endpoint_url=st.endpoint_url,
                    config=Config(
                        connect_timeout=st.connect_timeout_seconds,
                        read_timeout=st.read_timeout_seconds,
                        retries={"max_attempts": st.max_attempts, "mode": "standard"},
                        max_pool_connections=max(10, st.max_concurrency),
                    ),
                )
            return self._client

    def _bucket_key(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = self.root.partition("/")
        return bucket, f"{prefix}/{key}" if prefix else key

    def _protection(self, lock_until: datetime | None = None) -> dict:
        """The upload parameters for the archive's encryption and, for a committed object, its lock."""
        st, params = self.settings, {}
        if st.sse != "none":
            params["ServerSideEncryption"] = st.sse
        if st.sse == "aws:kms":
            if st.kms_key_id:
                params["SSEKMSKeyId"] = st.kms_key_id
            params["BucketKeyEnabled"] = st.bucket_key
        if lock_until is not None and st.object_lock is not None:
            params["ObjectLockMode"] = st.object_lock.mode
            params["ObjectLockRetainUntilDate"] = lock_until
        return params

    def where(self, key: str) -> str:
        """The human-readable location of a key, for messages."""
        return f"{self.url}/{key}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _call(self, what: str, key: str, fn, *args, **kwargs):
        from botocore.exceptions import ClientError

        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except ClientError as e:  # the store's own error code, in one line
            error = e.response.get("Error", {})
            code = str(error.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
            if code in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(self.where(key)) from None
            message = (error.get("Message") or "").strip().splitlines()
            detail = f"{code}: {message[0]}" if message else code
            line = f"{self.where(key)}: {what} refused by the store ({detail})"
            raise (AccessDenied if code in ("AccessDenied", "403") else ArchiveUnavailable)(line) from None
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
        """Every object under ``key`` with its size, by its path below ``key`` (a folder's as
        ``tokenizer/vocab.json``), from one listing (nothing is read)."""
        path = self._path(key)
        self.fs.invalidate_cache(path)  # what is there now, not what an earlier listing saw
        try:
            entries = self._call("list", key, self.fs.find, path, detail=True)
        except FileNotFoundError:
            return {}
        below = len(path.rstrip("/").split("/"))
        return {
            "/".join(name.rstrip("/").split("/")[below:]): int(e.get("size") or 0)
            for name, e in entries.items()
            if e.get("type") != "directory"
        }

    def read(self, key: str) -> bytes:
        return self._call("read", key, self.fs.cat_file, self._path(key))

    def write(self, key: str, data: bytes, lock_until: datetime | None = None) -> None:
        """A small object, all or nothing: an S3 PUT is atomic (sent with its CRC64NVME, the
        archive's encryption and, given ``lock_until``, its Object Lock); on a directory it is
        written to a temporary name and renamed, as a manifest (the commit marker) must never be
        half there."""
        path = self._path(key)
        if self.is_local:
            self._call("write", key, _write_local, Path(path), data)
        else:
            self._put("write", key, data, _crc64nvme(data), lock_until)

    def _put(self, what: str, key: str, data: bytes, crc: int, lock_until: datetime | None = None) -> None:
        """One PUT with its CRC64NVME (which the store checks the body against), the archive's
        encryption and, given ``lock_until``, its Object Lock."""
        bucket, name = self._bucket_key(key)
        self._call(
            what,
            key,
            self.client.put_object,
            Bucket=bucket,
            Key=name,
            Body=data,
            ChecksumAlgorithm="CRC64NVME",
            ChecksumCRC64NVME=crc64nvme_b64(crc),
            **self._protection(lock_until),
        )

    def head(self, key: str) -> Stored | None:
        """The store's own facts about an object, nothing downloaded; None if it is not there."""
        bucket, name = self._bucket_key(key)
        try:
            h = self._call(
                "head", key, self.client.head_object, Bucket=bucket, Key=name, ChecksumMode="ENABLED"
            )
        except FileNotFoundError:
            return None
        until = h.get("ObjectLockRetainUntilDate")
        return Stored(
            size=int(h["ContentLength"]),
            crc64nvme=h.get("ChecksumCRC64NVME"),
            checksum_type=h.get("ChecksumType"),
            sse=h.get("ServerSideEncryption"),
            kms_key_id=h.get("SSEKMSKeyId"),
            bucket_key=bool(h.get("BucketKeyEnabled")),
            lock_mode=h.get("ObjectLockMode"),
            retain_until=until.isoformat() if until is not None else None,
        )

    def heads(self, keys: list[str]) -> dict[str, Stored | None]:
        return dict(self.parallel(lambda key: (key, self.head(key)), keys))

    def check_object_lock(self) -> None:
        """Before anything goes up: the bucket must have Object Lock enabled, or the archive's
        ``object_lock`` could not be kept (the store's own error code if it says so)."""
        bucket, _ = self._bucket_key("")
        answer = self._call(
            "object lock configuration", "", self.client.get_object_lock_configuration, Bucket=bucket
        )
        enabled = answer.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled")
        if enabled != "Enabled":
            raise ArchiveUnavailable(
                f"{self.url}: the bucket's Object Lock is {enabled or 'not enabled'}; nothing uploaded"
            )

    def lock(self, keys: list[str], until: datetime) -> None:
        """Object Lock retention on objects already there (the committed copy's data objects)."""
        mode = self.settings.object_lock.mode

        def one(key):
            bucket, name = self._bucket_key(key)
            self._call(
                "object lock",
                key,
                self.client.put_object_retention,
                Bucket=bucket,
                Key=name,
                Retention={"Mode": mode, "RetainUntilDate": until},
                ChecksumAlgorithm="CRC64NVME",
            )

        self.parallel(one, keys)

    def remove_versions(self, key: str) -> None:
        """Every version of every object under ``key`` (on a versioned bucket, as an Object Lock
        bucket is, a plain delete only hides an object behind a delete marker)."""
        bucket, prefix = self._bucket_key(key)
        paginator = self.client.get_paginator("list_object_versions")
        pages = self._call(
            "list versions", key, lambda: list(paginator.paginate(Bucket=bucket, Prefix=prefix + "/"))
        )
        versions = [
            {"Key": v["Key"], "VersionId": v["VersionId"]}
            for page in pages
            for v in page.get("Versions", []) + page.get("DeleteMarkers", [])
        ]
        for start in range(0, len(versions), 1000):
            answer = self._call(
                "delete",
                key,
                self.client.delete_objects,
                Bucket=bucket,
                Delete={"Objects": versions[start : start + 1000], "Quiet": True},
                ChecksumAlgorithm="CRC64NVME",
            )
            for error in answer.get("Errors", []):
                raise ArchiveUnavailable(
                    f"{self.url}/{error['Key'].removeprefix(self._bucket_key('')[1])}: delete refused "
                    f"by the store ({error.get('Code')}: {error.get('Message', '').strip()})"
                )

    def put_checked(
        self,
        local: Path,
        key: str,
        want: tuple[int, str],
        hashing: Hashing,
        progress: Callable[[int], None] | None = None,
        parts_pool: "_PartsPool | None" = None,
    ) -> Sent:
        """Upload one file in one read that also re-hashes it as its manifest does (``want``: size,
        hash) and computes its CRC64NVME, sent with it: a single PUT up to one part, else a
        multipart upload of checksum type FULL_OBJECT. A file that no longer matches its manifest
        is not uploaded (the multipart upload is aborted), and raises SourceChanged."""
        if parts_pool is None:
            with _PartsPool(self.concurrency) as pool:
                return self.put_checked(local, key, want, hashing, progress, pool)
        source, size = _SourceRead(local, hashing), local.stat().st_size
        with open(local, "rb") as f:
            if size <= self.chunk_bytes:
                data = source.read(f)
                source.check(want)
                self._put("upload", key, data, source.crc)
                if progress:
                    progress(len(data))
            else:
                self._put_multipart(key, f, source, want, progress, parts_pool)
        return source.sent(uploaded=True)

    def _put_multipart(
        self, key: str, f, source: _SourceRead, want: tuple[int, str], progress, parts_pool: _PartsPool
    ) -> None:
        """A multipart upload of checksum type FULL_OBJECT, completed only if the whole file read
        as ``want``; on any failure the parts in flight are waited for and the upload aborted."""
        bucket, name = self._bucket_key(key)
        upload = self._call(
            "upload",
            key,
            self.client.create_multipart_upload,
            Bucket=bucket,
            Key=name,
            ChecksumAlgorithm="CRC64NVME",
            ChecksumType="FULL_OBJECT",
            **self._protection(),
        )["UploadId"]
        pending = []
        try:
            self._send_parts(f, source, (bucket, name, key, upload), progress, parts_pool, pending)
            parts = [part.result() for part in pending]
            source.check(want)
            self._call(
                "upload",
                key,
                self.client.complete_multipart_upload,
                Bucket=bucket,
                Key=name,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                ChecksumCRC64NVME=crc64nvme_b64(source.crc),
                ChecksumType="FULL_OBJECT",
            )
        except BaseException:
            for part in pending:  # no part may land after the abort
                with contextlib.suppress(BaseException):
                    part.result()
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload)
            raise

    def _send_parts(
        self, f, source: _SourceRead, upload: tuple, progress, parts_pool: _PartsPool, pending: list
    ) -> None:
        """The file read and hashed in order (one CRC over all of it) while its parts go up to
        ``upload`` (bucket, name, key, upload id) in parallel on the parts pool, at most
        ``concurrency`` parts in memory across files; each part's future is appended to ``pending``
        as it is submitted. Stops at the end of the file or at the first failed part (its error is
        raised when ``pending`` is waited for)."""
        while not any(part.done() and part.exception() for part in pending):
            parts_pool.room.acquire()
            try:
                data = source.read(f, self.chunk_bytes)
                if data:
                    pending.append(
                        parts_pool.submit(self._put_part, *upload, len(pending) + 1, data, progress)
                    )
            except BaseException:
                parts_pool.room.release()
                raise
            if not data:
                parts_pool.room.release()
                return

    def _put_part(self, bucket, name, key, upload, number, data, progress) -> dict:
        part_crc = crc64nvme_b64(_crc64nvme(data))
        answer = self._call(
            "upload",
            key,
            self.client.upload_part,
            Bucket=bucket,
            Key=name,
            UploadId=upload,
            PartNumber=number,
            Body=data,
            ChecksumAlgorithm="CRC64NVME",
            ChecksumCRC64NVME=part_crc,
        )
        if progress:
            progress(len(data))
        return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC64NVME": part_crc}

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

        self.parallel(put, pairs)
        if self.is_local and pairs:  # on disk, uploaded must mean on the disk before the commit
            self._call(
                "upload",
                pairs[0][1],
                make_durable,
                [Path(self._path(key)) for _, key in pairs],
                Path(self.root),
            )

    def put_checked_files(
        self,
        items: list[tuple[Path, str, tuple[int, str]]],
        hashing: Hashing,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, Sent]:
        """``put_checked`` for many files in parallel: (local, key, (size, hash)) each; the parts
        of large files go up in parallel too."""
        with _PartsPool(self.concurrency) as parts:
            return dict(
                self.parallel(
                    lambda item: (
                        item[1],
                        self.put_checked(item[0], item[1], item[2], hashing, progress, parts),
                    ),
                    items,
                )
            )

    def get_files(self, pairs: list[tuple[str, Path]], progress: Callable[[int], None] | None = None) -> None:
        def get(pair):
            key, local = pair
            self._call(
                "download", key, self.fs.get_file, self._path(key), str(local), callback=_Relay(progress)
            )

        self.parallel(get, pairs)

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

        return dict(self.parallel(one, keys))

    def parallel(self, fn, items) -> list:
        """``fn`` of each item on the store's concurrency (no more threads than items), in order."""
        with ThreadPoolExecutor(
            max_workers=max(1, min(self.concurrency, len(items) or 1, os.cpu_count() * 4))
        ) as pool:
            return list(pool.map(fn, items))
