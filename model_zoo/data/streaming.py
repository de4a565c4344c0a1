"""Streaming dataset builds: a corpus of any size cut into pieces that worker processes
tokenize, pack and write as MindRecord files of their own, in bounded memory.

A build runs in three passes over the inputs:
1. `scan_corpus` (main process) counts the documents and records where each piece starts:
   a piece is the run of documents that starts once `piece_bytes` of input have been read
   since the last one began. It also checks every input (UTF-8, JSON) before work starts.
2. The tokenizer, when one is trained, is trained on the train documents' lines, which
   SentencePiece samples (`tokenizer_sentences`, shuffled) in bounded memory.
3. `build_pieces` runs a model's piece builder on every piece, in `workers` processes. A
   piece's files and numbers depend on the piece alone, so the dataset is the same for any
   number of workers.

A document is held out when `heldout_draw(seed, index)` < heldout_fraction: the split is
document-level, follows the document's position in the corpus and nothing else, and needs
no pass over the whole corpus first. A corpus whose draws put every document in one split
gives the other split the document with the lowest (highest) draw.

A build is resumable: `.build-plan.json` records the scan and the settings, each finished
piece a `.piece-NNNNN.json` with its files' sizes and SHA-256; a build run again with the
same settings and inputs keeps the finished pieces and builds the others.
"""

import concurrent.futures
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from model_zoo.data.corpus import (DEFAULT_JSON_KEY, DocumentStart, describe_sources,
                                   input_bytes, input_entries, iter_documents)
from model_zoo.data.manifest import check_no_dataset, check_positive, write_manifest
from model_zoo.errors import DataError
from model_zoo.files import read_json_or_none, sha256_of, write_json_atomically

PLAN_FILE = ".build-plan.json"
PIECE_RECORD = ".piece-{:05d}.json"
PIECE_RECORD_PATTERN = r"\.piece-\d{5}\.json"
MAX_AUTO_SHARD_MB = 64     # pieces cut by default: about AUTO_PIECES of them, within these
MIN_AUTO_SHARD_MB = 16     # sizes (a small corpus stays one piece, a large one is balanced)
AUTO_PIECES = 16
DEFAULT_TOKENIZER_SENTENCES = 1_000_000
PROGRESS_SECONDS = 5.0
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class BuildOptions:
    """How a streaming build reads, splits and cuts its corpus (the data commands' flags)."""

    json_key: str = DEFAULT_JSON_KEY
    heldout_fraction: float = 0.05
    seed: int = 1
    workers: Optional[int] = None         # default: the cores
    shard_size: Optional[float] = None    # MB of input per piece (None: `auto_piece_bytes`)
    num_files: Optional[int] = None
    tokenizer_sentences: int = DEFAULT_TOKENIZER_SENTENCES

    @classmethod
    def from_args(cls, args):
        """The options of parsed `add_build_arguments` flags."""
        return cls(json_key=args.json_key, heldout_fraction=args.heldout_fraction,
                   seed=args.seed, workers=args.workers, shard_size=args.shard_size,
                   num_files=args.num_files, tokenizer_sentences=args.tokenizer_sentences)

    def check(self):
        workers = default_workers() if self.workers is None else self.workers
        check_positive("workers", workers)
        if self.num_files is not None and self.shard_size is not None:
            raise DataError("give --shard-size or --num-files, not both")
        if self.num_files is not None:
            check_positive("num_files", self.num_files)
        elif self.shard_size is not None and not self.shard_size > 0:
            raise DataError(f"shard_size must be a positive number of MB, got {self.shard_size!r}")
        if not isinstance(self.tokenizer_sentences, int) or self.tokenizer_sentences < 0:
            raise DataError(f"tokenizer_sentences must be 0 (every line) or a positive "
                            f"number of lines, got {self.tokenizer_sentences!r}")
        return workers

    def pieces(self) -> dict:
        if self.num_files:
            return {"num_files": self.num_files}
        return {"shard_mb": self.shard_size or "auto"}

    def piece_bytes(self):
        return None if self.shard_size is None else int(self.shard_size * 1e6)


def add_build_arguments(parser):
    """The flags of a streaming build (`BuildOptions`), after `add_input_arguments`."""
    parser.add_argument("--heldout-fraction", type=float, default=0.05,
                        help="fraction of documents held out for evaluation (default 0.05)")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the train/heldout split, the tokenizer's sample and "
                             "what else is drawn (default 1)")
    add_piece_arguments(parser)


def add_piece_arguments(parser):
    """The flags of a streaming build that say how its inputs are cut and built."""
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="processes that tokenize and write pieces of the corpus "
                             "(default: the cores of this machine)")
    parser.add_argument("--shard-size", type=float, default=None, metavar="MB",
                        help=f"MB of input text per piece, each written as its own files "
                             f"(default: a sixteenth of the corpus, at least "
                             f"{MIN_AUTO_SHARD_MB} and at most {MAX_AUTO_SHARD_MB})")
    parser.add_argument("--num-files", type=int, default=None, metavar="N",
                        help="cut the corpus in about N pieces of equal size instead")
    parser.add_argument("--tokenizer-sentences", type=int, default=DEFAULT_TOKENIZER_SENTENCES,
                        metavar="N",
                        help=f"lines of the train split the tokenizer is trained on, a "
                             f"shuffled sample; 0 for all "
                             f"(default {DEFAULT_TOKENIZER_SENTENCES:,})")


def streaming_build(output_dir, sources, options: BuildOptions, *, settings: dict, splits,
                    label: str, tokenizer_for, build_piece, job: dict, corpus=None):
    """Run the passes of a build (module docstring) and return (plan, the pieces' records
    in order, tokenizer); the caller writes dataset.json with `finish_build`.

    `settings`: the model's settings that change the output (e.g. seq_length), recorded
    with the options and inputs so that only the same build is resumed. `tokenizer_for(plan,
    rule, entries)`: the tokenizer (trained with `planned_tokenizer`, or given).
    `build_piece(job, piece)`: a module-level function writing one piece's files of
    `splits` (`shard_name`) and returning its record, `{"splits": {split: numbers, "files"
    among them}}`; `job` reaches it with entries, json_key, rule, tokenizer,
    tokenizer_sha256, output_dir and pieces (their count) added. `corpus`: what is read
    and how it is scanned and split (`DocumentCorpus`, the default, reads documents).
    """
    output_dir = Path(output_dir)
    check_no_dataset(output_dir)
    workers = options.check()
    corpus = corpus or DocumentCorpus(sources, options.json_key)
    entries = corpus.entries
    settings = dict(settings, inputs=corpus.signature(), json_key=options.json_key,
                    heldout_fraction=options.heldout_fraction, seed=options.seed,
                    tokenizer_sentences=options.tokenizer_sentences, pieces=options.pieces())
    plan = load_plan(output_dir, settings)
    if plan is None:
        clear_build(output_dir, splits)
        started = time.perf_counter()
        plan = dict(corpus.scan(options), settings=settings)
        output_dir.mkdir(parents=True, exist_ok=True)
        save_plan(output_dir, plan)
        print(f"scanned {plan['documents']:,} {corpus.unit}, {plan['bytes'] / 1e6:,.1f} MB, "
              f"in "
              f"{time.perf_counter() - started:.1f} s: {len(plan['pieces'])} piece(s)",
              flush=True)
    else:
        print(f"resuming the unfinished build in {output_dir}", flush=True)
    rule = corpus.rule(plan)
    tokenizer = tokenizer_for(plan, rule, entries)
    pieces = plan_pieces(plan, corpus.start_type)
    tokenizer_sha256 = sha256_of(tokenizer.model_path)
    records = {piece.index: record for piece in pieces
               if (record := finished_piece(output_dir, piece, tokenizer_sha256))}
    job = dict(job, entries=entries, json_key=options.json_key, rule=rule,
               tokenizer=str(tokenizer.model_path), tokenizer_sha256=tokenizer_sha256,
               output_dir=str(output_dir), pieces=len(pieces), splits=list(splits))
    todo = [piece for piece in pieces if piece.index not in records]
    records.update(build_pieces(build_piece, job, todo, workers, label=label,
                                total_bytes=sum(piece.bytes for piece in todo),
                                unit=corpus.unit))
    return plan, [records[piece.index] for piece in pieces], tokenizer


class DocumentCorpus:
    """The documents of a build's sources, scanned by `scan_corpus` and split by
    `SplitRule`: what `streaming_build` reads unless it is given another corpus (one with
    the same attributes and methods)."""

    unit = "documents"
    start_type = DocumentStart

    def __init__(self, sources, json_key: str):
        self.entries = input_entries(sources)
        self.json_key = json_key

    def signature(self) -> list:
        return input_signature(self.entries)

    def scan(self, options: BuildOptions) -> dict:
        return scan_corpus(self.entries, self.json_key,
                           heldout_fraction=options.heldout_fraction, seed=options.seed,
                           piece_bytes=options.piece_bytes(), num_files=options.num_files)

    def rule(self, plan: dict):
        return plan_rule(plan)


def planned_tokenizer(output_dir, plan: dict, path, train):
    """The tokenizer in `path` that an earlier run of this build trained (its plan records
    the file's SHA-256), else the one `train()` trains there now, recorded in the plan."""
    path = Path(path)
    if plan.get("tokenizer_sha256") and path.is_file() \
            and sha256_of(path) == plan["tokenizer_sha256"]:
        from model_zoo.data.tokenizer import load_tokenizer_file
        return load_tokenizer_file(path)
    started = time.perf_counter()
    tokenizer = train()
    print(f"trained the tokenizer ({tokenizer.vocab_size} pieces) in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    plan["tokenizer_sha256"] = sha256_of(path)
    save_plan(Path(output_dir), plan)
    return tokenizer


_TOKENIZERS = {}   # a worker's tokenizers, loaded once for all its pieces


def piece_tokenizer(job: dict, load):
    """`load(path)` of the job's tokenizer, kept for the worker's later pieces (keyed by the
    file's SHA-256 too: a build retrained in the same place gets the new one)."""
    key = (job["tokenizer"], job["tokenizer_sha256"])
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load(job["tokenizer"])
    return _TOKENIZERS[key]


def split_totals(records: list, splits, numbers) -> dict:
    """Each split's files (in piece order) and the sums of its `numbers` over the pieces."""
    summary = {}
    for split in splits:
        parts = [record["splits"][split] for record in records]
        summary[split] = {"files": [file for part in parts for file in part["files"]],
                          **{key: sum(part[key] for part in parts) for key in numbers}}
    return summary


def build_summary(plan: dict) -> dict:
    """The `build` entry of dataset.json: what was read and how it was cut."""
    settings = plan["settings"]
    return {"documents": plan["documents"], "input_bytes": plan["bytes"],
            "pieces": len(plan["pieces"]), "piece_bytes": plan["piece_bytes"],
            **settings["pieces"],
            "tokenizer_sentences": settings["tokenizer_sentences"]}


def finish_build(output_dir, manifest: dict, sources, records: list,
                 record_sources: bool = True) -> dict:
    """Write dataset.json (with the SHA-256 the workers took of their files, and `sources`
    for `data.sources` checks unless not `record_sources`) and remove the build's notes.
    Returns what was written."""
    sources = [str(source) for source in sources]
    manifest = dict(manifest, source=manifest.get("source") or describe_sources(sources))
    known = {name: info for record in records for name, info in record["files"].items()}
    written = write_manifest(output_dir, manifest, sources if record_sources else None,
                             known_files=known)
    clear_build_notes(Path(output_dir))
    return written


def heldout_draw(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for document `index`, a function of (seed, index) alone
    (SplitMix64), so any reader of any piece decides a document's split the same way."""
    value = (seed * 0xD1B54A32D192ED03 + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return (value ^ (value >> 31)) / 2.0 ** 64


@dataclass(frozen=True)
class SplitRule:
    """Which documents are held out (see the module docstring)."""

    heldout_fraction: float
    seed: int
    forced_heldout: Optional[int] = None   # a document held out whatever its draw
    forced_train: Optional[int] = None     # a document trained on whatever its draw

    def heldout(self, index: int) -> bool:
        if index == self.forced_heldout:
            return True
        if index == self.forced_train:
            return False
        return heldout_draw(self.seed, index) < self.heldout_fraction


@dataclass(frozen=True)
class Piece:
    """A run of consecutive documents that one worker builds into its own files."""

    index: int
    start: DocumentStart       # where its first document starts
    first_document: int        # the corpus index of its first document
    documents: int
    bytes: int


def scan_corpus(entries, json_key, *, heldout_fraction: float, seed: int,
                piece_bytes: Optional[int] = None, num_files: Optional[int] = None) -> dict:
    """Pass 1: the pieces of the corpus and its split rule, as a JSON-ready dict.

    Pieces are cut every `piece_bytes` of input, or in `num_files` pieces of about equal
    size (cut by `input_bytes`, so about that many), or when neither is given every
    `auto_piece_bytes` of input. DataError for fewer than 2 documents or
    a heldout_fraction outside (0, 1), and for unreadable input (named by file and line).
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be between 0 and 1 (exclusive), "
                        f"got {heldout_fraction}")
    piece_bytes = chosen_piece_bytes(sum(input_bytes(entry) for entry in entries),
                                     piece_bytes, num_files)
    cutter = PieceCutter(piece_bytes)
    heldout_count = 0
    lowest = highest = (None, None)     # (draw, index) of the extreme draws
    for index, document in enumerate(iter_documents(entries, json_key)):
        # a gzip file is cut only where it starts: reading from inside one means
        # decompressing everything before (give a large corpus as many .gz files)
        cutter.add(index, document.start, document.size, cuttable=document.start.offset == 0
                   or not _is_gzip(entries[document.start.entry]))
        draw = heldout_draw(seed, index)
        heldout_count += draw < heldout_fraction
        if lowest[0] is None or draw < lowest[0]:
            lowest = (draw, index)
        if highest[0] is None or draw > highest[0]:
            highest = (draw, index)
    count = cutter.count
    if count < 2:
        raise DataError(f"need at least 2 documents to split into train and heldout, got {count}")
    rule = SplitRule(heldout_fraction, seed,
                     forced_heldout=lowest[1] if heldout_count == 0 else None,
                     forced_train=highest[1] if heldout_count == count else None)
    return dict(cutter.plan(), rule=asdict(rule))


class PieceCutter:
    """Cuts a stream of units (documents, sentence pairs) into pieces as a scan reads it:
    a piece starts at the first cuttable unit once `piece_bytes` of input have been read
    since the previous cut point."""

    def __init__(self, piece_bytes: int):
        self.piece_bytes = piece_bytes
        self.pieces, self.count, self.total_bytes = [], 0, 0
        self.start, self.first, self.bytes = None, 0, 0
        self.next_cut = piece_bytes

    def add(self, index: int, start, size: int, cuttable: bool = True):
        """Unit `index` (the next one), starting at `start` (a NamedTuple), `size` bytes."""
        if self.start is None or (self.total_bytes >= self.next_cut and cuttable):
            if self.start is not None:
                self._close(index)
                self.next_cut = (self.total_bytes // self.piece_bytes + 1) * self.piece_bytes
            self.start, self.first, self.bytes = start, index, 0
        self.total_bytes += size
        self.bytes += size
        self.count = index + 1

    def _close(self, stop: int):
        self.pieces.append(Piece(len(self.pieces), self.start, self.first, stop - self.first,
                                 self.bytes))

    def plan(self) -> dict:
        """The scan's pieces, as the plan records them."""
        if self.start is not None:
            self._close(self.count)
            self.start = None
        return {"documents": self.count, "bytes": self.total_bytes,
                "piece_bytes": self.piece_bytes,
                "pieces": [asdict(piece) for piece in self.pieces]}


def chosen_piece_bytes(total_bytes: int, piece_bytes: Optional[int] = None,
                       num_files: Optional[int] = None) -> int:
    """The piece size of a corpus of `total_bytes`: `piece_bytes`, or that of `num_files`
    equal pieces, or when neither is given `auto_piece_bytes`."""
    if num_files is not None:
        piece_bytes = -(-total_bytes // num_files)
    elif piece_bytes is None:
        piece_bytes = auto_piece_bytes(total_bytes)
    return max(1, piece_bytes)


def auto_piece_bytes(total_bytes: int) -> int:
    """The default piece size: a sixteenth of the corpus, so that workers share it evenly,
    within [MIN_AUTO_SHARD_MB, MAX_AUTO_SHARD_MB] MB (a function of the corpus alone, so the
    dataset stays the same for any number of workers)."""
    return int(min(max(total_bytes / AUTO_PIECES, MIN_AUTO_SHARD_MB * 1e6),
                   MAX_AUTO_SHARD_MB * 1e6))


def _is_gzip(entry) -> bool:
    return not isinstance(entry, str) and entry.suffix == ".gz"


def plan_rule(plan: dict) -> SplitRule:
    return SplitRule(**plan["rule"])


def plan_pieces(plan: dict, start_type=DocumentStart) -> list:
    return [Piece(**dict(piece, start=start_type(*piece["start"])))
            for piece in plan["pieces"]]


def train_documents(entries, json_key, rule: SplitRule):
    """The texts of the train split's documents, in order (pass 2's input)."""
    for index, document in enumerate(iter_documents(entries, json_key)):
        if not rule.heldout(index):
            yield document.text


def piece_documents(entries, json_key, rule: SplitRule, piece: Piece):
    """(document index, text, is held out, input bytes) of each document of `piece`."""
    documents = iter_documents(entries, json_key, piece.start)
    for index, document in piece_units(documents, piece, str(entries[piece.start.entry])):
        yield index, document.text, rule.heldout(index), document.size


def piece_units(units, piece: Piece, input_name: str):
    """(corpus index, unit) of each unit (document, sentence pair) of `piece`, taken from
    `units`, an iterator of the inputs from where the piece starts; DataError naming
    `input_name` if the inputs changed since the scan found the piece."""
    for index in range(piece.first_document, piece.first_document + piece.documents):
        unit = next(units, None)
        if unit is None or (index == piece.first_document and
                            tuple(unit.start) != tuple(piece.start)):
            raise DataError(f"{input_name}: the input changed since the build began (piece "
                            f"{piece.index} no longer starts where it did); delete the "
                            f"unfinished build's folder and build again")
        yield index, unit
    units.close()


def shard_name(split: str, piece: int, pieces: int) -> str:
    """The file a split's samples of one piece go to: `train.mindrecord` for a one-piece
    dataset, else `train-00003-of-00016.mindrecord`."""
    if pieces == 1:
        return f"{split}.mindrecord"
    return f"{split}-{piece:05d}-of-{pieces:05d}.mindrecord"


# --- progress, shared by the worker processes -------------------------------------------
_COUNTERS = None   # documents, tokens, input bytes done, in a shared array


def _set_counters(counters):
    global _COUNTERS
    _COUNTERS = counters


def _start_worker(counters, build_pid: int):
    """A worker's start: the progress counters, and an end with the build's process even
    when that one is killed (SIGKILL gives it no chance to stop the pool, and the workers
    and multiprocessing's resource tracker would run on, orphaned): Linux's parent-death
    signal."""
    _set_counters(counters)
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux
        return
    if os.getppid() != build_pid:   # the build died before the signal was set
        os._exit(1)


def count_progress(documents: int, tokens: int, size: int):
    """Called by piece builders as they go: adds to the build's progress line."""
    if _COUNTERS is not None:
        with _COUNTERS.get_lock():
            _COUNTERS[0] += documents
            _COUNTERS[1] += tokens
            _COUNTERS[2] += size


class ProgressLine(threading.Thread):
    """Prints documents/s, tokens/s and MB/s of the pieces being built every few seconds."""

    def __init__(self, counters, total_bytes: int, label: str, unit: str = "documents"):
        super().__init__(daemon=True)
        self.counters, self.total_bytes, self.label = counters, total_bytes, label
        self.unit = unit
        self.started = time.perf_counter()
        self.finished = threading.Event()

    def run(self):
        while not self.finished.wait(PROGRESS_SECONDS):
            self.report()

    def report(self):
        documents, tokens, size = list(self.counters)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        share = size / self.total_bytes if self.total_bytes else 1.0
        remaining = elapsed * (1 - share) / share if share > 0 else float("inf")
        print(f"{self.label}: {min(share, 1.0):.0%} {documents:,} {self.unit} "
              f"({documents / elapsed:,.0f}/s), {tokens:,} tokens ({tokens / elapsed:,.0f}/s), "
              f"{size / 1e6:,.1f} MB ({size / 1e6 / elapsed:,.2f} MB/s)"
              + (f", {remaining:,.0f} s left" if share < 1 else ""), flush=True)

    def stop(self):
        self.finished.set()
        self.join()


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def build_pieces(build_piece, job: dict, pieces: list, workers: int, *, label: str,
                 total_bytes: int, unit: str = "documents") -> dict:
    """Pass 3: {piece index: build_piece(job, piece)} for every piece, in `workers` spawned
    processes (in this one for a single worker or piece); a progress line as they go.

    `build_piece` is a module-level function (the workers import it by name); an error in
    one piece stops the build, and the pieces finished before it stay for a resumed build.
    """
    if not pieces:   # a resumed build whose pieces were all finished
        return {}
    context = multiprocessing.get_context("spawn")
    counters = context.Array("q", 3)
    progress = ProgressLine(counters, total_bytes, label, unit)
    progress.start()
    results = {}
    try:
        if workers == 1 or len(pieces) == 1:
            _set_counters(counters)
            try:
                for piece in pieces:
                    results[piece.index] = _run_piece(build_piece, job, piece)
            finally:
                _set_counters(None)
        else:
            # spawned, not forked: MindSpore's threads do not survive a fork
            with concurrent.futures.ProcessPoolExecutor(
                    min(workers, len(pieces)), mp_context=context,
                    initializer=_start_worker, initargs=(counters, os.getpid())) as pool:
                futures = {pool.submit(_run_piece, build_piece, job, piece): piece
                           for piece in pieces}
                try:
                    for future in concurrent.futures.as_completed(futures):
                        results[futures[future].index] = future.result()
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
    finally:
        progress.stop()
    progress.report()
    return results


def _run_piece(build_piece, job: dict, piece: Piece) -> dict:
    """Build a piece and note it as finished (`record_piece`), in the worker."""
    output_dir = Path(job["output_dir"])
    for split in job["splits"]:   # what an earlier try of this piece may have left
        name = shard_name(split, piece.index, job["pieces"])
        for path in (output_dir / name, output_dir / f"{name}.db"):
            path.unlink(missing_ok=True)
    record = build_piece(job, piece)
    return record_piece(output_dir, piece, record, job["tokenizer_sha256"])


# --- resuming -----------------------------------------------------------------------------
def load_plan(output_dir: Path, settings: dict) -> Optional[dict]:
    """The plan of an earlier, unfinished build in `output_dir` with these settings (inputs
    unchanged), or None."""
    plan = read_json_or_none(output_dir / PLAN_FILE)
    # compared as JSON gives them back (tuples become lists)
    if plan is None or plan.get("settings") != json.loads(json.dumps(settings)):
        return None
    return plan


def save_plan(output_dir: Path, plan: dict):
    write_json_atomically(output_dir / PLAN_FILE, plan)


def finished_piece(output_dir: Path, piece: Piece, tokenizer_sha256: str) -> Optional[dict]:
    """The record of a piece an earlier run of this build finished (its files still the
    size they were written), or None."""
    record = read_json_or_none(output_dir / PIECE_RECORD.format(piece.index))
    if record is None or record.get("tokenizer_sha256") != tokenizer_sha256:
        return None
    for name, recorded in record["files"].items():
        path = output_dir / name
        if not path.is_file() or path.stat().st_size != recorded["bytes"]:
            return None
    return record


def record_piece(output_dir: Path, piece: Piece, record: dict, tokenizer_sha256: str) -> dict:
    """Note a finished piece with the sizes and SHA-256 of its files."""
    files = {name: {"bytes": (output_dir / name).stat().st_size,
                    "sha256": sha256_of(output_dir / name)}
             for split in record["splits"].values() for data_file in split["files"]
             for name in (data_file, f"{data_file}.db")}
    record = dict(record, files=files, tokenizer_sha256=tokenizer_sha256)
    write_json_atomically(output_dir / PIECE_RECORD.format(piece.index), record)
    return record


def clear_build(output_dir: Path, splits, keep_plan: bool = False):
    """Remove what an earlier build of these splits left in `output_dir`: their MindRecord
    files (one or sharded), the piece records and (unless `keep_plan`) the plan."""
    pattern = re.compile(rf"({'|'.join(map(re.escape, splits))})(-\d{{5}}-of-\d{{5}})?"
                         rf"\.mindrecord(\.db)?|{PIECE_RECORD_PATTERN}")
    if not output_dir.is_dir():
        return
    for entry in os.scandir(output_dir):
        if pattern.fullmatch(entry.name) or (entry.name == PLAN_FILE and not keep_plan):
            os.unlink(entry.path)


def clear_build_notes(output_dir: Path):
    """Remove the plan and piece records of a build that has finished."""
    for entry in os.scandir(output_dir):
        if entry.name == PLAN_FILE or re.fullmatch(PIECE_RECORD_PATTERN, entry.name):
            os.unlink(entry.path)


def input_signature(entries) -> list:
    """What identifies the inputs for a resumed build: each file's path, size and time of
    last change."""
    signature = []
    for entry in entries:
        if isinstance(entry, str):
            signature.append([entry, sys.version.split()[0]])
        else:
            status = entry.stat()
            signature.append([str(entry), status.st_size, status.st_mtime_ns])
    return signature
