#!/usr/bin/env python3
"""A harder task for the main job's hooks: a character-level language model of Python source.

The text is the Python standard library's own source, which ships with every interpreter: the
``.py`` files under ``sysconfig.get_paths()["stdlib"]`` in sorted order (test suites, demos and
installed packages left out), read as bytes, up to ``--chars`` bytes. Tokens are the ASCII
bytes; every other byte is one "other" token (127), so the vocabulary is 128. The first 90% of
the text trains, the last 10% tests: the model predicts each byte from the ``--context`` bytes
before it.

The model: an embedding of each context byte, concatenated, then ``--depth`` blocks of
Linear + LayerNorm + ReLU of width ``--hidden``, then a Linear to the 128 logits. Weights of
several shapes (embedding, matrices, norms, biases) reach the hooks, unlike the digits MLP.

Every configuration of the main job (``train_digits.CONFIGS``: allreduce, the 16-bit hooks,
PowerSGD, post-local SGD, ZeRO, the quantized hooks and torch's quantization hooks, ...) trains
the same model from the same weights on the same batches; the report is the main job's, with the
test loss per character (nats) beside the next-byte accuracy. Launch like the main job::

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        benchmarks/train_charlm.py --out out/charlm --only quantiz,fp16_compress_hook

The text depends on the interpreter's version (its standard library), so compare rows within
one run; the report names the Python version.
"""
import os
import sys
import sysconfig
from typing import List, Tuple

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_digits as td  # noqa: E402  (the main job's machinery: configurations, report)

VOCAB = 128
OTHER = VOCAB - 1  # every non-ASCII byte
# Folders of the standard library that are not its own source text: test suites, demos, the
# packages pip installs into it.
SKIP_DIRS = {"test", "tests", "idle_test", "turtledemo", "site-packages", "dist-packages",
             "__pycache__", "ensurepip", "lib2to3", "venv", "config-3"}


def stdlib_text(max_bytes: int) -> Tuple[bytes, int]:
    """The first `max_bytes` bytes of the standard library's .py files, sorted by path, each
    followed by a newline; also how many files that took."""
    root = sysconfig.get_paths()["stdlib"]
    files: List[str] = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-"))
        files += [os.path.join(here, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda f: os.path.relpath(f, root))
    parts, size = [], 0
    for f in files:
        with open(f, "rb") as fh:
            parts.append(fh.read() + b"\n")
        size += len(parts[-1])
        if size >= max_bytes:
            break
    if size < max_bytes // 2:
        raise RuntimeError(f"train_charlm: only {size} bytes of .py source under {root}")
    return b"".join(parts)[:max_bytes], len(parts)


def charlm_split(text: bytes, seed: int, context: int, train_samples: int, test_samples: int):
    """(x_train, y_train, x_test, y_test): x a (N, context) int64 window of bytes, y the byte
    after it. Training windows are drawn at random (seeded) from the first 90% of the text, test
    windows evenly spaced over the last 10%: they never overlap the training text."""
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long().clamp_(max=OTHER)
    cut = int(0.9 * len(tokens))
    offsets = torch.arange(context)
    g = torch.Generator().manual_seed(seed)
    ends = torch.randint(context, cut, (train_samples,), generator=g)
    x_tr, y_tr = tokens[ends[:, None] - context + offsets], tokens[ends]
    ends = torch.linspace(cut + context, len(tokens) - 1, test_samples).long()
    x_te, y_te = tokens[ends[:, None] - context + offsets], tokens[ends]
    return x_tr, y_tr, x_te, y_te


class CharMLP(nn.Module):
    def __init__(self, context: int, embed: int, hidden: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        layers: List[nn.Module] = []
        width = context * embed
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, VOCAB))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x).flatten(1))


def charlm_task(args) -> td.Task:
    text, n_files = stdlib_text(args.chars)
    data = charlm_split(text, args.seed, args.context, args.train_samples, args.test_samples)
    py = ".".join(map(str, sys.version_info[:3]))
    return td.Task(
        title="char-level LM",
        model=(f"char MLP: {args.context} bytes x embedding {args.embed}, "
               + ", ".join([f"Linear+LayerNorm {args.hidden}"] * args.depth)
               + f", Linear to {VOCAB}; text: Python {py}'s standard library, {n_files} files, "
               f"{args.chars:,} bytes"),
        test_set=(f"{len(data[2]):,} next-byte predictions spread over the held-out last 10% of "
                  "the text"),
        data=data, make_net=lambda: CharMLP(args.context, args.embed, args.hidden, args.depth))


def _extend(p) -> None:
    p.add_argument("--chars", type=int, default=2_000_000, help="bytes of source text")
    p.add_argument("--context", type=int, default=32, help="bytes the model sees")
    p.add_argument("--embed", type=int, default=16, help="embedding width per byte")
    p.add_argument("--train-samples", type=int, default=160_000,
                   help="training windows per epoch (drawn once, shuffled per epoch)")
    p.add_argument("--test-samples", type=int, default=8_192)
    # The main job's defaults suit the digits MLP; these suit this model (SGD, momentum 0.9).
    p.set_defaults(epochs=2, batch_size=64, hidden=512, depth=2, lr=0.1, out="out/charlm")


def main(argv=None) -> int:
    args = td.parse_args(argv, extend=_extend, description=__doc__.split("\n")[0])
    if args.export_cpp_data:
        raise SystemExit("train_charlm: --export-cpp-data is the digits job's (train_digits.py)")
    return td.main(make_task=charlm_task, args=args)


if __name__ == "__main__":
    sys.exit(main())
