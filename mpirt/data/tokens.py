"""Token datasets read window by window, a deterministic DP-sharded sampler, and corpus preparation.

On disk a dataset is a directory in nanoGPT's convention: flat uint16 ``train.bin`` and
``val.bin``, plus ``meta.json`` = {"vocab_size", "tokenizer", "train_tokens", "val_tokens",
"format": "uint16", "eos_id", "train_max_id", "val_max_id", "train_mtime_ns", "val_mtime_ns"}.
``tokenizer`` is "bytes" (ids are byte values, vocab 256, the document separator is byte 0) or
the path of a HF ``tokenizers`` JSON file, relative to the dataset directory (``prepare`` copies
it in as ``tokenizer.json``). A plain nanoGPT directory without meta.json loads too, with
vocab_size and tokenizer unknown (None).

The token files are never mapped: :class:`TokenFile` reads each window with ``os.pread``, so a
process's resident memory does not grow with the corpus (a memory map's pages stay resident once
read). The largest id of each split lets a run refuse ids outside its model's vocabulary at
start-up without reading the data; it is trusted only while the file's mtime is the one recorded
with it. A split without a valid record is scanned at start-up when it holds at most
:data:`SCAN_TOKENS` tokens; a larger one is not read at start-up at all: every window read is
checked instead, and an id out of range ends the run naming the file and the token's offset.

Batches are pure functions of (seed, step, dp_rank): every data-parallel layout sees the same
global batch, and resuming at step k reproduces batch k. This module never imports mpi4py.

Over 400 lines: the token file format, its checks and the sampler that reads it are one contract.
"""
import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from mpirt.cpu import sysinfo

MAX_VOCAB = 65536  # ids are stored as uint16: 0..65535
BYTE_EOS = 0  # document separator of the byte tokenizer (NUL never occurs in text)
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|eos|>")
_CHUNK = 1 << 22  # bytes read at a time when streaming a file
_SCAN = 1 << 22  # tokens looked at a time when scanning a split for its largest id
SPLITS = ("train", "val")


# meta.json's fields that the loader reads, with the types they must have (None: absent is fine)
META_TYPES = {"format": str, "vocab_size": int, "tokenizer": str, "train_tokens": int, "val_tokens": int,
              "train_max_id": int, "val_max_id": int, "train_mtime_ns": int, "val_mtime_ns": int}


class MetaError(ValueError):
    """A prepared dataset's meta.json that cannot be used (its message names the file and the fault)."""


def read_meta(path: Path) -> dict:
    """A dataset's meta.json as a dict; :class:`MetaError` naming the file and the fault when it is
    not JSON, not an object, or a field has the wrong type."""
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MetaError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise MetaError(f"{path}: expected a JSON object, found {type(meta).__name__}")
    for key, kind in META_TYPES.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise MetaError(f"{path}: {key} should be {'an integer' if kind is int else 'a string'}, "
                             f"found {value!r}")
    return meta


SCAN_TOKENS = 1 << 26   # a split without a recorded largest id is scanned at start-up up to this size (128 MB)


class DataError(ValueError):
    """A fault in the token data found while a run reads it (the message names the file); the
    training script ends the run with it in one line, with the last checkpoint."""


class TokenIdError(DataError):
    """A token id at or above the model's vocabulary, found as a window was read (names the file
    and the token's offset)."""


class TokenFileChanged(DataError):
    """A token file whose size or modification time changed since it was opened: truncated,
    grown or rewritten in place under a running job (its batches would no longer be the ones the
    run and its checkpoints describe)."""


class TokenFile:
    """One split's uint16 tokens on disk, read window by window with ``os.pread``: nothing is
    mapped, so resident memory stays flat for any file size. ``len()``, ``nbytes``, ``read``,
    ``windows`` and integer or slice indexing (each a read of just those tokens). With ``limit``
    set (the model's vocabulary, :meth:`TokenDataset.check_ids`), every read refuses an id at or
    above it with :class:`TokenIdError`. Every read also checks (one ``fstat``) that the file
    still has the size and modification time it had when opened, else :class:`TokenFileChanged`
    (a file replaced by a rename is not a change: the open descriptor keeps reading the old one)."""

    dtype = np.dtype(np.uint16)

    def __init__(self, path: Path, n: int):
        self.path, self.n, self.limit = Path(path), int(n), None
        self._fd = os.open(self.path, os.O_RDONLY)
        opened = os.fstat(self._fd)
        self._opened = (opened.st_size, opened.st_mtime_ns)

    def check_unchanged(self) -> None:
        """:class:`TokenFileChanged`, saying what changed, when the file's size or modification
        time is no longer what it was when opened."""
        now = os.fstat(self._fd)
        (size, mtime), was = (now.st_size, now.st_mtime_ns), self._opened
        if (size, mtime) == was:
            return
        if size != was[0]:
            what = f"{'truncated' if size < was[0] else 'grown'} from {was[0]:,} to {size:,} bytes"
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime / 1e9))
            what = f"rewritten in place (same size, modified {when})"
        raise TokenFileChanged(f"data: {self.path} changed under the running job: {what}")

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self.n * self.dtype.itemsize

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` as a fresh array, checked against ``limit``."""
        if start < 0 or count < 0 or start + count > self.n:
            raise IndexError(f"{self.path}: tokens [{start}, {start + count}) outside [0, {self.n})")
        buf = bytearray(count * self.dtype.itemsize)
        view, done = memoryview(buf), 0
        while done < len(buf):                       # pread may return less than asked
            got = os.preadv(self._fd, [view[done:]], start * self.dtype.itemsize + done)
            if got <= 0:
                self.check_unchanged()             # a file cut short under the job says so
                raise OSError(f"{self.path}: short read at byte {start * self.dtype.itemsize + done}")
            done += got
        self.check_unchanged()
        out = np.frombuffer(buf, dtype=self.dtype)
        if self.limit is not None and count and int(out.max()) >= self.limit:
            at = int(np.argmax(out >= self.limit))
            raise TokenIdError(f"data: {self.path} holds token id {int(out[at])} >= the model's vocab_size "
                               f"{self.limit} (token {start + at})")
        return out

    def windows(self, starts, length: int) -> np.ndarray:
        """Tokens ``[s, s + length)`` for each start ``s``, as rows of a (len(starts), length) array."""
        out = np.empty((len(starts), length), dtype=self.dtype)
        for row, start in enumerate(starts):
            out[row] = self.read(int(start), length)
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            picked = range(*key.indices(self.n))
            if not picked:
                return np.empty(0, dtype=self.dtype)
            lo = min(picked[0], picked[-1])
            # a strided view of the span read (an index array would be 8 bytes a token: 4x the read)
            span = self.read(lo, abs(picked[-1] - picked[0]) + 1)
            return span[::picked.step] if picked.step > 0 else span[::-1][::-picked.step]
        if isinstance(key, (int, np.integer)):
            i = int(key) + self.n if key < 0 else int(key)
            return self.read(i, 1)[0]
        raise TypeError(f"{self.path}: index with an int or a slice (windows() for several), not {type(key).__name__}")

    def __del__(self):
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)


class TokenDataset:
    """A prepared token directory: ``.train``/``.val`` (:class:`TokenFile`), ``.vocab_size``, ``.meta``.

    Raises FileNotFoundError / ValueError naming the path for a missing, empty or odd-sized .bin.
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        self.meta = read_meta(meta_path) if meta_path.exists() else {}
        if self.meta.get("format", "uint16") != "uint16":
            raise ValueError(f"{meta_path}: unsupported format {self.meta['format']!r}")
        self.vocab_size = self.meta.get("vocab_size")
        self.tokenizer = self.meta.get("tokenizer")
        self.train = _open_bin(self.directory / "train.bin", self.meta.get("train_tokens"))
        self.val = _open_bin(self.directory / "val.bin", self.meta.get("val_tokens"))
        self._hf = None

    def max_id(self, split: str, scan_up_to: int | None = None) -> int | None:
        """The largest token id in ``split`` ("train" or "val"): meta.json's record when the file
        is unchanged since it was written, else a scan in chunks of bounded memory; None when the
        split holds more than ``scan_up_to`` tokens (not scanned)."""
        tokens = getattr(self, split)
        recorded, stamp = self.meta.get(f"{split}_max_id"), self.meta.get(f"{split}_mtime_ns")
        if recorded is not None and stamp == (self.directory / f"{split}.bin").stat().st_mtime_ns:
            return int(recorded)
        if scan_up_to is not None and len(tokens) > scan_up_to:
            return None
        return max_token_id(tokens)

    def check_ids(self, vocab_size: int) -> list[str]:
        """Refuse (ValueError naming the file) a split holding an id ``>= vocab_size``: it would
        fail at a forward or an evaluation, hours into the run. Each split is checked from its
        record, or scanned when at most :data:`SCAN_TOKENS` long; a larger split without a record
        is checked as its windows are read. Returns a note for each split checked that way."""
        notes = []
        for split in SPLITS:
            tokens = getattr(self, split)
            top = self.max_id(split, scan_up_to=SCAN_TOKENS)
            tokens.limit = vocab_size
            if top is None:
                notes.append(f"{tokens.path} ({len(tokens):,} tokens) records no largest token id: its ids are "
                             f"checked as batches are read")
            elif top >= vocab_size:
                raise ValueError(f"data: {tokens.path} holds token id {top} >= the model's vocab_size {vocab_size}")
        return notes

    def _hf_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.directory}: no meta.json, the tokenizer is unknown")
        if self._hf is None:
            from tokenizers import Tokenizer
            self._hf = Tokenizer.from_file(str(self.directory / self.tokenizer))
        return self._hf

    def encode(self, text):
        """Token ids (list of int) of ``text``."""
        if self.tokenizer == "bytes":
            return list(text.encode("utf-8"))
        return self._hf_tokenizer().encode(text).ids

    def decode(self, ids):
        """Text of the token ids; invalid UTF-8 of the byte tokenizer becomes U+FFFD."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if self.tokenizer == "bytes":
            if ids.size and (ids.min() < 0 or ids.max() > 255):
                raise ValueError("byte tokenizer ids must lie in 0..255")
            return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return self._hf_tokenizer().decode(ids.tolist())


def _open_bin(path, expected):
    """The :class:`TokenFile` of a .bin file, with errors that name the path."""
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(f"{path}: size {size} bytes is not a non-empty whole number of uint16")
    if expected is not None and expected != size // 2:
        raise ValueError(f"{path}: meta.json says {expected} tokens, the file holds {size // 2}")
    return TokenFile(path, size // 2)


def max_token_id(tokens) -> int:
    """The largest id of a token array or memmap, read ``_SCAN`` tokens at a time."""
    return max(int(tokens[i:i + _SCAN].max()) for i in range(0, len(tokens), _SCAN))


def _check_layout(batch_size, seq_len, dp_rank, dp_size):
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    if batch_size % dp_size:
        raise ValueError(f"global batch_size {batch_size} is not divisible by dp_size {dp_size}")
    rows = batch_size // dp_size
    return dp_rank * rows, (dp_rank + 1) * rows


def _gather(tokens, starts, seq_len):
    """x, y (int64, shape (len(starts), seq_len)) from windows tokens[s : s+seq_len+1] of a
    :class:`TokenFile` (one read a window) or an array."""
    if isinstance(tokens, TokenFile):
        buf = tokens.windows(starts, seq_len + 1).astype(np.int64)
    else:
        idx = starts[:, None] + np.arange(seq_len + 1)  # (B, T+1)
        buf = np.asarray(tokens[idx]).astype(np.int64)  # one vectorised gather
    return np.ascontiguousarray(buf[:, :-1]), np.ascontiguousarray(buf[:, 1:])


def get_batch(tokens, step, *, batch_size, seq_len, seed, dp_rank=0, dp_size=1):
    """This rank's share of training batch ``step``: x, y int64, (batch_size//dp_size, seq_len).

    ``batch_size`` is the global batch. Its window starts, uniform in [0, len(tokens)-seq_len-1],
    come from PCG64 seeded by SeedSequence([seed, step]) only (raw bits modulo the range, so the
    stream is stable across NumPy versions); rank r gets rows [r*B/dp, (r+1)*B/dp). y is x
    shifted by one token.
    """
    lo, hi = _check_layout(batch_size, seq_len, dp_rank, dp_size)
    n_starts = len(tokens) - seq_len  # valid starts: 0 .. len-seq_len-1
    if n_starts < 1:
        raise ValueError(f"split has {len(tokens)} tokens, fewer than seq_len+1 = {seq_len + 1}")
    if seed < 0 or step < 0:
        raise ValueError(f"seed ({seed}) and step ({step}) must be >= 0")
    raw = np.random.PCG64(np.random.SeedSequence([seed, step])).random_raw(batch_size)
    starts = (raw % np.uint64(n_starts)).astype(np.int64)  # (B,)
    return _gather(tokens, starts[lo:hi], seq_len)


def split_microbatches(x, y, n):
    """Split a batch into ``n`` gradient-accumulation micro-batches [(x_k, y_k), ...].

    Rows are split in order, so concatenating the micro-batches gives back (x, y). With global
    batch B, dp ranks D and n micro-batches each has B/(D*n) rows; average the n losses (or scale
    each by 1/n) to get the gradient of the rank's whole share.
    """
    if n < 1 or len(x) % n:
        raise ValueError(f"{len(x)} rows cannot be split into {n} equal micro-batches")
    return list(zip(np.split(x, n), np.split(y, n)))


def num_eval_batches(tokens, batch_size, seq_len):
    """How many evaluation batches of ``batch_size`` non-overlapping windows fit in ``tokens``."""
    return ((len(tokens) - 1) // seq_len) // batch_size


def get_eval_batch(tokens, index, *, batch_size, seq_len, dp_rank=0, dp_size=1):
    """This rank's share of evaluation batch ``index`` (independent of any seed).

    Batch ``index`` holds windows i = index*batch_size + j, j < batch_size; window i covers
    tokens [i*T, i*T+T+1): x its first T tokens, y its last T. Rows are dp-sharded as in get_batch.
    """
    lo, hi = _check_layout(batch_size, seq_len, dp_rank, dp_size)
    available = num_eval_batches(tokens, batch_size, seq_len)
    if not 0 <= index < available:
        raise ValueError(f"eval batch {index} requested but a split of {len(tokens)} tokens holds "
                         f"only {available} batches of {batch_size}x{seq_len}")
    windows = index * batch_size + np.arange(lo, hi, dtype=np.int64)
    return _gather(tokens, windows * seq_len, seq_len)


def _list_files(src, pattern, exclude):
    """Non-empty regular files under src matching pattern, sorted; hidden and excluded skipped."""
    files = []
    for p in src.rglob(pattern):
        parts = p.relative_to(src).parts
        hidden = any(s.startswith(".") or s in exclude for s in parts)
        if not hidden and p.is_file() and p.stat().st_size:
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(src).as_posix())


def _val_files(src, files, val_fraction):
    """Files that go whole to val: taken in hash order of the relative path while their bytes fit
    in val_fraction of the total (the smallest file if none fits). Empty for a single file."""
    if len(files) < 2:
        return set()
    sizes = {p: p.stat().st_size for p in files}
    budget, used, val = val_fraction * sum(sizes.values()), 0, set()
    def key(p):
        return hashlib.sha1(p.relative_to(src).as_posix().encode()).digest()
    for p in sorted(files, key=key):
        if used + sizes[p] <= budget:
            val.add(p)
            used += sizes[p]
    return val or {min(files, key=lambda p: sizes[p])}


def _document_tokens(path, tok):
    """Yield uint16 token arrays of one file (None tok = bytes); nothing for undecodable files."""
    if tok is None:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                yield np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16)
        return
    raw = path.read_bytes()
    if b"\0" in raw:
        return  # binary file
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return
    yield np.asarray(tok.encode(text).ids, dtype=np.uint16)


def _load_tokenizer(path):
    """(tokenizer, vocab_size, eos_id) of a HF tokenizers JSON file."""
    from tokenizers import Tokenizer
    if not Path(path).is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own untyped errors for a file it cannot parse
        raise ValueError(f"tokenizer {path}: not a Hugging Face tokenizers JSON file ({err})") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > MAX_VOCAB:
        raise ValueError(f"tokenizer {path} has vocab_size {vocab} > {MAX_VOCAB}, "
                         "its ids do not fit uint16")
    eos = next((tok.token_to_id(t) for t in _EOS_NAMES if tok.token_to_id(t) is not None), None)
    return tok, vocab, eos


def prepare(src_dir, out_dir, tokenizer=None, val_fraction=0.05, pattern="*", exclude=()):
    """Tokenise the files under ``src_dir`` into a dataset directory ``out_dir``; return its meta.

    Files: every regular file under src_dir (recursively) whose name matches the glob
    ``pattern``, in sorted order of relative path, skipping hidden entries and directories named
    in ``exclude``. tokenizer None = bytes (vocab 256, every file read as bytes); otherwise a HF
    tokenizers JSON file (binary or non-UTF-8 files are skipped). Every document is followed by
    the separator: byte 0, or the tokenizer's EOS token if it has one (meta "eos_id").
    Split: whole files go to val (see _val_files) for about val_fraction of the bytes; a single
    file has its last val_fraction of tokens split off. Written file by file into a temporary
    directory next to out_dir, renamed into place at the end (a crash leaves no out_dir).
    """
    src, out = Path(src_dir), Path(out_dir)
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if not src.is_dir():
        raise FileNotFoundError(f"source directory not found: {src}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {out} exists and is not empty")
    files = _list_files(src, pattern, set(exclude))
    if not files:
        raise ValueError(f"no files matching {pattern!r} under {src}")
    tok, vocab, eos = (None, 256, BYTE_EOS) if tokenizer is None else _load_tokenizer(tokenizer)
    val_files = _val_files(src, files, val_fraction)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        counts, docs = {"train": 0, "val": 0}, {"train": 0, "val": 0}
        with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
            for path in files:
                split = "val" if path in val_files else "train"
                f, n = (fval if split == "val" else ftrain), 0
                for ids in _document_tokens(path, tok):
                    ids.tofile(f)
                    n += ids.size
                if n and eos is not None:
                    np.array([eos], dtype=np.uint16).tofile(f)
                    n += 1
                counts[split] += n
                docs[split] += n > 0
        if not val_files and counts["train"] > 1:  # one file: move its tail into val.bin
            cut = counts["train"] - max(1, int(counts["train"] * val_fraction))
            np.memmap(tmp / "train.bin", dtype=np.uint16, mode="r")[cut:].tofile(tmp / "val.bin")
            os.truncate(tmp / "train.bin", 2 * cut)
            counts, docs = {"train": cut, "val": counts["train"] - cut}, {"train": 1, "val": 1}
        if min(counts.values()) < 1:
            raise ValueError(f"{src}: the train or val split came out empty ({counts})")
        meta = {"vocab_size": vocab, "tokenizer": "bytes", "train_tokens": counts["train"],
                "val_tokens": counts["val"], "format": "uint16", "eos_id": eos,
                "train_files": docs["train"], "val_files": docs["val"], "source": str(src)}
        for split in SPLITS:  # the bins are final: record their largest id and the mtime it holds for
            path = tmp / f"{split}.bin"
            meta[f"{split}_max_id"] = max_token_id(TokenFile(path, path.stat().st_size // 2))
            meta[f"{split}_mtime_ns"] = path.stat().st_mtime_ns
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
            meta["tokenizer"] = "tokenizer.json"
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache must stay readable
        for name in os.listdir(tmp):  # data on disk before the rename publishes it
            fd = os.open(tmp / name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        os.rename(tmp, out)  # atomic; replaces an empty out_dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _builtin_paths(cache_dir=None) -> tuple[Path, Path]:
    """(cache, the built-in corpus's directory in it): cache_dir, else $MPIRT_CACHE, else ~/.cache/mpirt."""
    cache = Path(cache_dir) if cache_dir else sysinfo.cache_dir()
    return cache, cache / f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-bytes"


def prepare_default(cache_dir=None) -> Path:
    """Prepare the built-in corpus in this process if it is not there yet (see
    :func:`default_dataset_dir`); returns its directory. Safe for many processes at once: an
    fcntl lock serialises preparation and later callers find the finished directory."""
    cache, out = _builtin_paths(cache_dir)
    if (out / "meta.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "meta.json").exists():
            print(f"mpirt: preparing the built-in corpus (this Python's standard library sources, byte-level) "
                  f"into {out}, once", file=sys.stderr, flush=True)
            prepare(sysconfig.get_paths()["stdlib"], out, pattern="*.py",
                    exclude=("site-packages", "dist-packages", "test", "tests", "idle_test"))
    return out


def default_dataset_dir(cache_dir=None) -> Path:
    """Directory of the built-in corpus, preparing it on first use: the .py files of this
    Python's standard library (no site-packages, no test dirs), byte-level, in
    ``cache_dir``, else $MPIRT_CACHE, else ~/.cache/mpirt.

    The preparation runs in a child process (``python -m mpirt.data default``), so that what it
    reads and writes never counts in the caller's memory: a training run measures its baseline
    and its peak in its own process, and a first run must not look like one that needs more.
    Raises OSError naming the directory and the child's last line when the preparation fails."""
    cache, out = _builtin_paths(cache_dir)
    if (out / "meta.json").exists():
        return out
    import subprocess
    child = subprocess.run([sys.executable, "-m", "mpirt.data", "default", "--cache-dir", str(cache)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sys.stderr.write("".join(line + "\n" for line in child.stderr.splitlines() if line.startswith("mpirt: ")))
    if child.returncode or not (out / "meta.json").exists():
        last = (child.stderr.strip().splitlines() or [f"exit code {child.returncode}"])[-1]
        raise OSError(f"preparing the built-in corpus into {out} failed: {last}")
    return out


def main(argv=None):
    """``python -m mpirt.data prepare SRC OUT [--tokenizer F] [--val-fraction F]`` | ``default``."""
    parser = argparse.ArgumentParser(prog="python -m mpirt.data",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenise a folder of text files into a dataset directory")
    p.add_argument("src_dir")
    p.add_argument("out_dir")
    p.add_argument("--tokenizer", help="HF tokenizers JSON file (default: bytes)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--pattern", default="*", help="glob for file names (default: all files)")
    d = sub.add_parser("default", help="print the built-in dataset dir, preparing it if needed")
    d.add_argument("--cache-dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "default":  # this process is the one that prepares
            print(prepare_default(args.cache_dir))
            return 0
        meta = prepare(args.src_dir, args.out_dir, args.tokenizer, args.val_fraction, args.pattern)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out_dir}: train {meta['train_tokens']} tokens ({meta['train_files']} files), "
          f"val {meta['val_tokens']} tokens ({meta['val_files']} files), "
          f"vocab {meta['vocab_size']} ({meta['tokenizer']})")
    return 0
