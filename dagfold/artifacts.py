"""Artifact storage: the outputs and checkpoints of task attempts.

A task process writes its outputs into ``$DAGFOLD_OUTPUT_DIR``; when the
attempt succeeds, its runner (a CPU worker or a GPU node agent) uploads them
here and the success report lists them (``Artifact``: URI, size, sha256,
content type). GPU checkpoints go to the same storage and a resumed attempt
reads its checkpoint back from it.

Two stores behind one interface (``ArtifactStore``):

* ``LocalArtifactStore``: a folder (the default, ``<data>/artifacts``; the
  embedded stack of ``make run``). URIs ``file:///abs/path``.
* ``S3ArtifactStore``: S3-compatible object storage through boto3 (AWS S3,
  S3Proxy, SeaweedFS, Ceph RGW, ...). URIs ``s3://bucket/key``. Credentials come from
  boto3's usual sources (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a
  profile, an instance role); never from a task.

``open_store(url, data_dir)`` picks one from a URL: ``""`` or ``file:PATH`` for
a folder, ``s3://bucket[/prefix]?endpoint=http://host:port&region=r`` for S3.

Keys: ``<tenant>/<job>/<task>/<attempt>/outputs/<name>`` and
``<tenant>/<job>/<task>/checkpoints/<name>``; every part is percent-quoted,
so a job ID with ``/`` or ``..`` never escapes its folder. Outputs are read
with hostile eyes (``open_outputs``): each file is opened once, from a
descriptor of its folder, without following a symlink at any level
(``O_NOFOLLOW``, ``openat``), checked on that descriptor (``fstat``: regular
files only; owned by the task's user when tasks run as one, so a hard link to a
secret is refused), and its sha256 is computed over the very bytes stored (one
pass). Names are relative POSIX paths without ``..``, and a count and a total
size bound what one attempt may upload.
"""

from __future__ import annotations

import contextlib
import hashlib
import mimetypes
import os
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from dagfold.exceptions import DagfoldError

CHUNK = 1024 * 1024
MAX_OUTPUT_FILES = 1000
MAX_OUTPUT_BYTES = 64 * 1024 ** 3  # per attempt
MAX_NAME_CHARS = 512


class ArtifactError(DagfoldError):
    """An artifact could not be stored or read (missing, refused, storage unreachable)."""


@dataclass(frozen=True)
class Artifact:
    """One stored output: what a success report, the API and the callback carry."""

    name: str  # relative path inside the output folder
    uri: str
    size: int
    sha256: str
    content_type: str

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "uri": self.uri, "size": self.size, "sha256": self.sha256,
                "content_type": self.content_type}


def _q(part: str) -> str:
    """One key part: percent-quoted, and a part of dots only (``.``, ``..``) quoted too (quote keeps dots)."""
    q = quote(part, safe="")
    if not q:
        return "%"  # the empty part: quote never yields a lone "%"
    return q.replace(".", "%2E") if set(q) <= {"."} else q


def output_prefix(tenant: str, job_id: str, task_id: str, attempt: int) -> str:
    return f"{_q(tenant)}/{_q(job_id)}/{_q(task_id)}/{int(attempt)}/outputs/"


def checkpoint_prefix(tenant: str, job_id: str, task_id: str) -> str:
    return f"{_q(tenant)}/{_q(job_id)}/{_q(task_id)}/checkpoints/"


def valid_name(name: str) -> bool:
    """A relative POSIX path of plain parts (no ``..``, no absolute path, no control characters)."""
    if not name or len(name) > MAX_NAME_CHARS or name.startswith("/") or "\\" in name:
        return False
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        return False
    return all(p not in ("", ".", "..") for p in name.split("/"))


def content_type(name: str) -> str:
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put where a file was never blocks the open (fstat then refuses it)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_DEPTH = 64


class HashingReader:
    """A file read once, front to back: ``read`` hands the bytes on and hashes them as they pass.

    So the sha256 and size a report carries are those of the bytes the store received, however the
    file changes meanwhile. Not seekable on purpose: boto3's transfer then buffers each part it reads
    (a retried part is sent from memory, never read again). Reads stop at ``limit`` bytes.
    """

    def __init__(self, f: IO[bytes], limit: int | None = None) -> None:
        self._f = f
        self._left = limit
        self._h = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        if self._left is not None:
            n = self._left if n is None or n < 0 else min(n, self._left)
        data = self._f.read(n if n is not None and n >= 0 else -1)
        self._h.update(data)
        self.size += len(data)
        if self._left is not None:
            self._left -= len(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def sha256(self) -> str:
        return self._h.hexdigest()


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _walk(dfd: int, prefix: str, depth: int = 0) -> Iterator[tuple[str, int, str]]:
    """(name, folder descriptor, entry) of every regular-looking entry under ``dfd``, sorted; folders are
    entered through descriptors opened with ``O_NOFOLLOW`` (a symlink at any level is never followed)."""
    if depth > MAX_DEPTH:
        return
    for entry in sorted(os.listdir(dfd)):
        try:
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(entry, _DIR_FLAGS, dir_fd=dfd)
            except OSError:
                continue  # swapped for a symlink or removed meanwhile
            with _fd(sub):
                yield from _walk(sub, f"{prefix}{entry}/", depth + 1)
        elif stat.S_ISREG(st.st_mode):
            yield f"{prefix}{entry}", dfd, entry


def _open_below(base: Path, parts: tuple[str, ...]) -> int:
    """A descriptor of the folder ``base/parts...``, each part opened from its parent's descriptor with
    ``O_NOFOLLOW`` (a symlink there is refused, ArtifactError)."""
    try:
        fd = os.open(base, _DIR_FLAGS)
    except OSError as exc:
        raise ArtifactError(f"folder {base} cannot be read: {exc}") from None
    for part in parts:
        try:
            sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise ArtifactError(f"checkpoint path part {part!r} cannot be read: {exc}") from None
        os.close(fd)
        fd = sub
    return fd


def _open_regular(dfd: int, entry: str, owner: int | None) -> IO[bytes] | None:
    """The entry opened once (no symlink followed), if it is a regular file (of ``owner``, when given)."""
    try:
        fd = os.open(entry, _FILE_FLAGS, dir_fd=dfd)
    except OSError:
        return None  # a symlink now (ELOOP), or gone
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def open_outputs(folder: Path | str, *, owner: int | None = None, max_files: int = MAX_OUTPUT_FILES,
                 max_bytes: int = MAX_OUTPUT_BYTES, dir_fd: int | None = None,
                 ) -> Iterator[tuple[str, IO[bytes], int]]:
    """The regular files under ``folder`` as (name, open file, size at opening), sorted, each opened once.

    Nothing is re-opened by path after a check: the folder is opened with ``O_NOFOLLOW`` and every
    entry from its folder's descriptor (``openat`` with ``O_NOFOLLOW``), then checked on the descriptor
    (``fstat``). Symlinks, special files, bad names and (with ``owner``) files of another user are
    skipped. ArtifactError past ``max_files`` files or ``max_bytes`` bytes. The caller reads each file
    (at most its size at opening) before taking the next; it is closed then. ``dir_fd``: ``folder``
    is a name in that folder.
    """
    try:
        root = os.open(folder, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ArtifactError(f"output folder {folder} cannot be read: {exc}") from None
    count = total = 0
    with _fd(root):
        for name, dfd, entry in _walk(root, ""):
            if not valid_name(name):
                continue
            f = _open_regular(dfd, entry, owner)
            if f is None:
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                count, total = count + 1, total + size
                if count > max_files:
                    raise ArtifactError(f"more than {max_files} output files")
                if total > max_bytes:
                    raise ArtifactError(f"outputs exceed {max_bytes} bytes")
                yield name, f, size


def output_files(folder: Path, *, max_files: int = MAX_OUTPUT_FILES,
                 max_bytes: int = MAX_OUTPUT_BYTES) -> list[tuple[str, Path]]:
    """The names (and paths, for display) of the files ``open_outputs`` would upload, sorted.

    Raises ArtifactError when the folder holds more than ``max_files`` files or ``max_bytes`` bytes.
    """
    return [(name, folder / name) for name, _, _ in open_outputs(folder, max_files=max_files, max_bytes=max_bytes)]


class ArtifactStore(ABC):
    """Where outputs and checkpoints live (see module docstring)."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """The URI of ``key`` in this store."""

    @abstractmethod
    def key_of(self, uri: str) -> str | None:
        """The key of a URI of this store; None when the URI is not one of this store's."""

    @abstractmethod
    def put_file(self, key: str, path: Path, content_type: str) -> None: ...

    @abstractmethod
    def put_stream(self, key: str, reader: HashingReader, content_type: str) -> None:
        """Store what ``reader`` yields, read once front to back (its digest is then the stored bytes')."""

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> None:
        """Copy the object to ``dest``; ArtifactError when it does not exist."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size, None when it does not exist."""

    @abstractmethod
    def iter_bytes(self, key: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """The object's bytes in chunks (ArtifactError when it does not exist)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many."""

    def presign(self, key: str, expires_s: int = 900) -> str | None:
        """A time-limited URL that downloads the object without credentials; None if the store has none."""
        return None

    def close(self) -> None:
        return None

    # -- the two uses -------------------------------------------------------------------
    def upload_outputs(self, folder: Path, prefix: str, *, owner: int | None = None,
                       **limits: int) -> list[Artifact]:
        """Upload every output file under ``folder`` to ``prefix``; the list for the success report.

        Each file is read once (``open_outputs``): the size and sha256 listed are those of the stored bytes.
        ``owner``: only files of this user ID (the task user's, when tasks run as one).
        """
        out = []
        for name, f, size in open_outputs(folder, owner=owner, **limits):
            ctype = content_type(name)
            reader = HashingReader(f, limit=size)
            self.put_stream(prefix + name, reader, ctype)
            out.append(Artifact(name, self.uri(prefix + name), reader.size, reader.sha256, ctype))
        return out

    def upload_checkpoint(self, path: Path, prefix: str, *, owner: int | None = None,
                          base: Path | None = None) -> str:
        """Store a checkpoint file (or every file of a checkpoint folder); returns its URI.

        Read like outputs (``open_outputs``): no symlink is followed, neither under ``path`` nor at
        ``path``; with ``base`` (the checkpoint folder ``path`` lies in) nor anywhere between the two.
        """
        rel = path.relative_to(base).parts if base is not None else (path.name,)
        if not rel:
            raise ArtifactError(f"checkpoint {path} is its folder")
        with _fd(_open_below(base if base is not None else path.parent, rel[:-1])) as dfd:
            try:
                st = os.stat(rel[-1], dir_fd=dfd, follow_symlinks=False)
            except OSError as exc:
                raise ArtifactError(f"checkpoint {path} cannot be read: {exc}") from None
            if stat.S_ISDIR(st.st_mode):
                for name, part, size in open_outputs(rel[-1], owner=owner, dir_fd=dfd):
                    self.put_stream(f"{prefix}{path.name}/{name}", HashingReader(part, limit=size),
                                    content_type(name))
                return self.uri(f"{prefix}{path.name}/")
            f = _open_regular(dfd, rel[-1], owner)
            if f is None:
                raise ArtifactError(f"checkpoint {path} is not a regular file (of the task's user)")
            with f:
                size = os.fstat(f.fileno()).st_size
                self.put_stream(prefix + path.name, HashingReader(f, limit=size), content_type(path.name))
        return self.uri(prefix + path.name)

    def fetch_checkpoint(self, uri: str, dest_dir: Path) -> Path:
        """Bring a stored checkpoint into ``dest_dir``; the local path a resumed process reads."""
        key = self.key_of(uri)
        if key is None:
            raise ArtifactError(f"checkpoint {uri!r} is not in this artifact store")
        dest_dir.mkdir(parents=True, exist_ok=True)
        if key.endswith("/"):  # a checkpoint folder
            base = key.rstrip("/").rsplit("/", 1)[-1]
            target = dest_dir / unquote(base)
            for sub in self.list(key):
                rel = sub[len(key):]
                if valid_name(rel):
                    self.get_file(sub, target / rel)
            return target
        target = dest_dir / unquote(key.rsplit("/", 1)[-1])
        self.get_file(key, target)
        return target

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, sorted."""


class LocalArtifactStore(ArtifactStore):
    """A folder (one host, or a shared mount every host reaches)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if p != self.root and self.root not in p.parents:
            raise ArtifactError(f"key {key!r} leaves the artifact folder")
        return p

    def uri(self, key: str) -> str:
        return (self.root / key).as_uri() + ("/" if key.endswith("/") else "")

    def key_of(self, uri: str) -> str | None:
        u = urlsplit(uri)
        if u.scheme != "file":
            return None
        path = unquote(u.path)
        root = self.root.as_posix() + "/"
        if not path.startswith(root):
            return None
        key = path[len(root):]
        try:
            self._path(key)
        except ArtifactError:
            return None
        return key

    def put_file(self, key: str, path: Path, content_type: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        shutil.copyfile(path, tmp)
        os.replace(tmp, dest)  # readers never see half a file

    def put_stream(self, key: str, reader: HashingReader, content_type: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        with tmp.open("wb") as out:
            while data := reader.read(CHUNK):
                out.write(data)
        os.replace(tmp, dest)  # readers never see half a file

    def get_file(self, key: str, dest: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ArtifactError(f"no artifact {key!r}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src != dest.resolve():
            tmp = dest.with_name(dest.name + ".part")
            tmp.unlink(missing_ok=True)
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)  # replaces a symlink left at ``dest``, never writes through it

    def size(self, key: str) -> int | None:
        p = self._path(key)
        return p.stat().st_size if p.is_file() else None

    def iter_bytes(self, key: str, chunk: int = CHUNK) -> Iterator[bytes]:
        p = self._path(key)
        if not p.is_file():
            raise ArtifactError(f"no artifact {key!r}")
        with p.open("rb") as f:
            while data := f.read(chunk):
                yield data

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*")
                      if p.is_file() and not p.name.endswith(".part"))

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for k in keys:
            self._path(k).unlink(missing_ok=True)
        base = self._path(prefix)
        if base.is_dir() and base != self.root:
            shutil.rmtree(base, ignore_errors=True)
        return len(keys)


class S3ArtifactStore(ArtifactStore):
    """S3-compatible object storage through boto3 (see module docstring)."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, create_bucket: bool = False, client: Any = None) -> None:
        import boto3
        from botocore.config import Config as BotoConfig

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client = client or boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
            config=BotoConfig(signature_version="s3v4", retries={"max_attempts": 5, "mode": "standard"},
                              s3={"addressing_style": "path"},
                              # CRC checksum headers only where S3 requires them: S3-compatible servers
                              # (S3Proxy, older MinIO/Ceph) refuse the ones boto3 adds by default
                              request_checksum_calculation="when_required",
                              response_checksum_validation="when_required"))
        self._missing = (self.client.exceptions.NoSuchKey,)
        if create_bucket:
            from botocore.exceptions import ClientError
            try:
                self.client.head_bucket(Bucket=bucket)
            except ClientError:
                self.client.create_bucket(Bucket=bucket)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._k(key)}"

    def key_of(self, uri: str) -> str | None:
        head = f"s3://{self.bucket}/{self.prefix}"
        if not uri.startswith(head):
            return None
        key = uri[len(head):]
        return key if all(p not in (".", "..") for p in key.split("/")) else None

    def put_file(self, key: str, path: Path, content_type: str) -> None:
        # upload_file: multipart for big files, with retries (s3transfer)
        self.client.upload_file(str(path), self.bucket, self._k(key), ExtraArgs={"ContentType": content_type})

    def put_stream(self, key: str, reader: HashingReader, content_type: str) -> None:
        # a stream that cannot seek: s3transfer reads it once, in order, and buffers each part it sends
        self.client.upload_fileobj(reader, self.bucket, self._k(key), ExtraArgs={"ContentType": content_type})

    def get_file(self, key: str, dest: Path) -> None:
        from botocore.exceptions import ClientError
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, self._k(key), str(dest))
        except ClientError as exc:
            raise ArtifactError(f"no artifact {key!r}: {exc}") from None

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._k(key))["ContentLength"])
        except ClientError:
            return None

    def iter_bytes(self, key: str, chunk: int = CHUNK) -> Iterator[bytes]:
        from botocore.exceptions import ClientError
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
        except ClientError as exc:
            raise ArtifactError(f"no artifact {key!r}: {exc}") from None
        try:
            yield from body.iter_chunks(chunk)
        finally:
            body.close()

    def list(self, prefix: str) -> list[str]:
        keys = []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._k(prefix))
        for page in pages:
            keys += [o["Key"][len(self.prefix):] for o in page.get("Contents", [])
                     if not o["Key"].endswith("/")]  # folder markers some servers list
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for k in keys:  # one by one: DeleteObjects needs a checksum header some S3-compatible servers refuse
            self.client.delete_object(Bucket=self.bucket, Key=self._k(k))
        return len(keys)

    def presign(self, key: str, expires_s: int = 900) -> str | None:
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._k(key)}, ExpiresIn=int(expires_s))
        return url

    def close(self) -> None:
        self.client.close()


def open_store(url: str, data_dir: Path) -> ArtifactStore:
    """The store a URL names: ``""`` -> ``<data_dir>/artifacts``; ``file:PATH``; ``s3://bucket/prefix?...``."""
    if not url:
        return LocalArtifactStore(data_dir / "artifacts")
    u = urlsplit(url)
    if u.scheme == "file":
        return LocalArtifactStore(Path(unquote(u.netloc + u.path)))
    if u.scheme == "s3":
        if not u.netloc:
            raise ArtifactError(f"artifact URL {url!r} names no bucket")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        return S3ArtifactStore(u.netloc, u.path, endpoint_url=q.get("endpoint"), region=q.get("region"),
                               create_bucket=q.get("create", "") in ("1", "true"))
    raise ArtifactError(f"artifact URL {url!r}: use file:PATH or s3://bucket/prefix")
