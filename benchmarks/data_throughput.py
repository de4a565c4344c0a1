"""GPT-2 dataset builds: MB/s, tokens/s and peak memory with 1 and 2 workers, beside a
reference encoder (Hugging Face `tokenizers` + numpy) of the same vocabulary, in one run.

The corpus is made on the fly: the docstrings of Python's standard library, shuffled and
repeated to each size (default 200 MB and 1 GB), as plain text with documents separated
by blank lines. One SentencePiece tokenizer (vocabulary 8,000, trained on the standard
library's docstrings) is given to every build with `--tokenizer`, so the figures are those
of the build itself: reading, tokenizing, packing 1,025-token samples and writing them as
MindRecord files. Each build is `model-zoo data gpt2` in its own process; peak memory is
the largest sum of the resident memory of it and its workers, sampled every 0.1 s.

The reference encodes the same text with the same vocabulary in `tokenizers` (the
SentencePiece model's pieces and merges, on one thread) and packs the ids with numpy into
an .npy file; the share of documents it encodes exactly as SentencePiece does is printed
beside it.

With `--model transformer` it builds translation datasets instead (`model-zoo data
transformer`, which trains its joint tokenizer, vocabulary 8,000, on a sample of the train
pairs): the corpus is a `.tsv` of the system's message-catalog pairs, shuffled and repeated
to each size, each copy numbered on both sides so that every pair is distinct. There is no
reference encoder for it; the figures are MB/s, pairs/s and peak memory.

    python benchmarks/data_throughput.py
    python benchmarks/data_throughput.py --sizes 50 --workers 1 2
    python benchmarks/data_throughput.py --model transformer --sizes 50 200 --workers 2
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = 8000
SEQ_LENGTH = 1024
REFERENCE_MB = 50   # the reference encodes this much of the corpus (its rate does not depend on it)
TRANSLATION_LENGTH = 128


def make_corpus(path: Path, megabytes: int):
    """The standard library's docstrings, shuffled and repeated to `megabytes` MB."""
    from model_zoo.data import python_docstrings_corpus
    documents = python_docstrings_corpus()
    rng = random.Random(0)
    target, written = megabytes * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            rng.shuffle(documents)
            for document in documents:
                text = document.replace("\n\n", "\n") + "\n\n"
                out.write(text)
                written += len(text.encode("utf-8"))
                if written >= target:
                    break


def make_pairs_corpus(path: Path, megabytes: int):
    """The message catalogs' English-German pairs as a .tsv, shuffled and repeated to
    `megabytes` MB, copy k of a pair numbered "(k)" on both sides."""
    from model_zoo.models.transformer.pairs import message_catalog_pairs
    pairs = message_catalog_pairs()
    rng = random.Random(0)
    target, written, copy = megabytes * 1_000_000, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            rng.shuffle(pairs)
            copy += 1
            for source, translation in pairs:
                line = f"{source} ({copy})\t{translation} ({copy})\n"
                out.write(line)
                written += len(line.encode("utf-8"))
                if written >= target:
                    break


def train_shared_tokenizer(path: Path):
    from model_zoo.data import python_docstrings_corpus, train_tokenizer
    return train_tokenizer(python_docstrings_corpus(), path, VOCAB)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (Linux /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        stack.extend(children.get(current, ()))
        try:
            with open(f"/proc/{current}/statm") as handle:
                total += int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def build(model: str, corpus: Path, tokenizer: Path, workers: int, output_dir: Path) -> dict:
    """One `model-zoo data MODEL` run: seconds, peak memory of its processes, manifest."""
    command = [sys.executable, "-m", "model_zoo", "data", model, "--input", str(corpus),
               "--output-dir", str(output_dir), "--workers", str(workers)]
    if model == "gpt2":
        command += ["--tokenizer", str(tokenizer), "--seq-length", str(SEQ_LENGTH)]
    else:
        command += ["--vocab-size", str(VOCAB), "--seq-length", str(TRANSLATION_LENGTH)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ, GLOG_v="3"))
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - started
    output = process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"build failed:\n{output}")
    manifest = json.loads((output_dir / "dataset.json").read_text())
    shutil.rmtree(output_dir)
    return {"seconds": seconds, "peak_rss": peak, "manifest": manifest}


def reference_encoder(tokenizer_model: Path):
    """A `tokenizers` BPE tokenizer with the SentencePiece model's pieces and merges, which
    splits text as our SentencePiece settings do: at spaces (kept as "▁" at a piece's start)
    and at newlines (a piece of their own), with no normalization."""
    import tokenizers
    from tokenizers import models, pre_tokenizers
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    found = SentencePieceExtractor(str(tokenizer_model)).extract(models.BPE)
    vocab, merges = found["vocab"], found["merges"]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>",
                                                fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.add_special_tokens(["\n"])
    return tokenizer


def reference(corpus: Path, tokenizer_model: Path, scratch: Path) -> dict:
    """Encode the first REFERENCE_MB of the corpus on one thread, pack with numpy, save."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    from model_zoo.data.corpus import input_entries, iter_documents
    from model_zoo.data.tokenizer import Tokenizer
    encoder = reference_encoder(tokenizer_model)
    documents, size = [], 0
    for document in iter_documents(input_entries([str(corpus)])):
        documents.append(document.text)
        size += document.size
        if size >= REFERENCE_MB * 1_000_000:
            break
    eos = Tokenizer(tokenizer_model).eos_id
    started = time.perf_counter()
    encoded = encoder.encode_batch(documents, add_special_tokens=False)
    ids = [np.asarray(item.ids + [eos], dtype=np.int32) for item in encoded]
    stream = np.concatenate(ids)
    rows = len(stream) // (SEQ_LENGTH + 1)
    np.save(scratch / "reference.npy", stream[:rows * (SEQ_LENGTH + 1)].reshape(rows, -1))
    seconds = time.perf_counter() - started
    sentencepiece = Tokenizer(tokenizer_model)
    sample = documents[::max(1, len(documents) // 2000)]
    same = sum(sentencepiece.encode(text) == encoder.encode(text, add_special_tokens=False).ids
               for text in sample)
    return {"mb_per_s": size / 1e6 / seconds, "tokens_per_s": len(stream) / seconds,
            "agreement": same / len(sample)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["gpt2", "transformer"], default="gpt2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 1000], metavar="MB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--scratch", help="folder for the corpora and builds (default: a "
                                          "temporary folder, removed afterwards)")
    args = parser.parse_args()
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="data-throughput-"))
    scratch.mkdir(parents=True, exist_ok=True)
    gpt2 = args.model == "gpt2"
    try:
        tokenizer = train_shared_tokenizer(scratch / "tokenizer.model").model_path if gpt2 \
            else None
        rows, ref = [], None
        for megabytes in args.sizes:
            corpus = scratch / (f"corpus-{megabytes}mb.txt" if gpt2 else
                                f"pairs-{megabytes}mb.tsv")
            if not corpus.exists():
                (make_corpus if gpt2 else make_pairs_corpus)(corpus, megabytes)
            if gpt2 and megabytes == min(args.sizes):
                ref = reference(corpus, tokenizer, scratch)
            for workers in args.workers:
                result = build(args.model, corpus, tokenizer, workers, scratch / "built")
                splits = result["manifest"]["splits"].values()
                units = result["manifest"]["build"]["documents" if gpt2 else "pairs"]
                tokens = sum(split["tokens"] for split in splits)
                rows.append((megabytes, workers, result, tokens, units))
                print(f"  built {megabytes} MB with {workers} worker(s) in "
                      f"{result['seconds']:.0f} s", flush=True)
        if gpt2:
            print(f"\nGPT-2 dataset builds (vocabulary {VOCAB}, samples of {SEQ_LENGTH + 1} "
                  f"tokens, given tokenizer), {os.cpu_count()} cores")
        else:
            print(f"\nTransformer dataset builds (joint vocabulary {VOCAB} trained in the "
                  f"build, pairs of at most {TRANSLATION_LENGTH} tokens), {os.cpu_count()} "
                  f"cores")
        unit = "docs/s" if gpt2 else "pairs/s"
        print(f"{'corpus':>8} {'workers':>7} {'MB/s':>7} {'tokens/s':>10} {unit:>9} "
              f"{'MB/s/core':>9} {'peak RSS':>9} {'seconds':>8}")
        for megabytes, workers, result, tokens, units in rows:
            rate = megabytes / result["seconds"]
            print(f"{megabytes:>6}MB {workers:>7} {rate:>7.2f} "
                  f"{tokens / result['seconds']:>10,.0f} {units / result['seconds']:>9,.0f} "
                  f"{rate / workers:>9.2f} {result['peak_rss'] / 2 ** 20:>7,.0f}MB "
                  f"{result['seconds']:>8.1f}")
        if ref is not None:
            print(f"{'reference':>8} {1:>7} {ref['mb_per_s']:>7.2f} "
                  f"{ref['tokens_per_s']:>10,.0f} {'':>9} {ref['mb_per_s']:>9.2f} {'':>9} "
                  f"{'':>8}  (tokenizers + numpy on {REFERENCE_MB} MB; "
                  f"{ref['agreement']:.1%} of documents encoded as SentencePiece does)")
        for workers in args.workers:
            peaks = {mb: result["peak_rss"] for mb, w, result, _, _ in rows if w == workers}
            if len(peaks) > 1:
                low, high = min(peaks), max(peaks)
                print(f"peak RSS, {workers} worker(s): {high} MB corpus / {low} MB corpus = "
                      f"{peaks[high] / peaks[low]:.2f}x (goal <= 1.2x)")
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
