"""Real variable-length data that needs no download: Python standard-library source code.

`load_stdlib_code` turns the functions and methods of a few well-populated standard-library
packages into token-id sequences, labelled with the package they come from. It reads the files of
the running interpreter (`sysconfig.get_paths()["stdlib"]`), so it is deterministic for a given
Python version and needs no network access and no cache on disk.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import io
import os
import sys
import sysconfig
import textwrap
import tokenize
from collections.abc import Sequence

import numpy as np

from keras_fastloop import _validation

__all__ = [
    "DEFAULT_STDLIB_GROUPS",
    "OOV_ID",
    "PAD_ID",
    "StdlibCode",
    "load_stdlib_code",
    "tokenize_source",
]

# The six largest library packages once `encodings` (generated codec boilerplate), `tkinter`
# (thin Tcl wrappers), `distutils` (deprecated) and the test suites are set aside: each gives
# about 400-950 functions/methods on CPython 3.11 (asyncio 950, xml 707, multiprocessing 569,
# email 522, importlib 431, unittest 408 before length filtering), and they are different enough
# in vocabulary to be learnable yet overlap (all use classes, exceptions, I/O).
DEFAULT_STDLIB_GROUPS = ("asyncio", "email", "importlib", "multiprocessing", "unittest", "xml")

PAD_ID = 0
OOV_ID = 1
_SPECIAL_TOKENS = ("<pad>", "<oov>")
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__"})
_LAYOUT_TOKENS = {
    tokenize.NEWLINE: "<newline>",
    tokenize.INDENT: "<indent>",
    tokenize.DEDENT: "<dedent>",
}
_DROPPED_TOKEN_TYPES = frozenset(
    {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
)


@dataclasses.dataclass(frozen=True)
class StdlibCode:
    """Tokenized standard-library functions with their package labels (see `load_stdlib_code`).

    Attributes:
        x_train: list of 1-D int32 NumPy arrays (ragged). Token ids; no padding (`PAD_ID` = 0
            never occurs), unknown tokens are `OOV_ID` = 1.
        y_train: int32 NumPy array, shape `[num_train]`. Class ids into `class_names`.
        x_val: list of 1-D int32 NumPy arrays. Validation sequences.
        y_val: int32 NumPy array, shape `[num_val]`.
        names_train: tuple of str. `"package/path.py:Class.method:line"` of each training
            example (unique; the line number tells apart property getters and setters).
        names_val: tuple of str. Same for validation.
        vocab: tuple of str. `vocab[i]` is the token of id `i` (`vocab[0]="<pad>"`,
            `vocab[1]="<oov>"`); built from the training split only, by frequency.
        class_names: tuple of str. Package of each class id.
        python_version: str. `"major.minor.micro"` of the interpreter the source came from.
    """

    x_train: list[np.ndarray]
    y_train: np.ndarray
    x_val: list[np.ndarray]
    y_val: np.ndarray
    names_train: tuple[str, ...]
    names_val: tuple[str, ...]
    vocab: tuple[str, ...]
    class_names: tuple[str, ...]
    python_version: str

    @property
    def pad_id(self) -> int:
        """Id used for padding (0)."""
        return PAD_ID

    @property
    def oov_id(self) -> int:
        """Id of out-of-vocabulary tokens (1)."""
        return OOV_ID


def tokenize_source(source: str) -> list[str]:
    """Splits Python source into tokens with the standard `tokenize` module.

    Comments, blank-line markers and the encoding/end markers are dropped; NEWLINE, INDENT and
    DEDENT become `"<newline>"`, `"<indent>"`, `"<dedent>"`; every other token is its text.

    Args:
        source: str. Python source code (dedented).

    Returns:
        List of str tokens.

    Raises:
        tokenize.TokenError or SyntaxError: if the source cannot be tokenized.

    Example:

    >>> tokenize_source("def f(a):\\n    return a + 1\\n")[:6]
    ['def', 'f', '(', 'a', ')', ':']
    """
    tokens = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _DROPPED_TOKEN_TYPES:
            continue
        tokens.append(_LAYOUT_TOKENS.get(tok.type, tok.string))
    return tokens


def _iter_units(tree, lines):
    """Module-level functions and the methods of module-level classes, with qualified names."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{member.name}", member


@functools.lru_cache(maxsize=8)
def _parse_groups(root, groups):
    """[(group index, name, tokens)] for every unit of every group, in a fixed order."""
    units = []
    for g_index, group in enumerate(groups):
        top = os.path.join(root, group)
        paths = [top + ".py"] if os.path.isfile(top + ".py") else []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
            paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
        for path in paths:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            try:
                tree = ast.parse(source)
            except SyntaxError:  # pragma: no cover - stdlib files parse on their own version
                continue
            lines = source.splitlines(keepends=True)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            for qualname, node in _iter_units(tree, lines):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                segment = textwrap.dedent("".join(lines[start - 1 : node.end_lineno]))
                try:
                    tokens = tokenize_source(segment)
                except (tokenize.TokenError, SyntaxError):  # pragma: no cover
                    continue
                units.append((g_index, f"{rel}:{qualname}:{node.lineno}", tuple(tokens)))
    return tuple(units)


def load_stdlib_code(
    vocab_size: int = 2000,
    max_length: int | None = 512,
    min_length: int = 1,
    groups: Sequence[str] = DEFAULT_STDLIB_GROUPS,
    validation_split: float = 0.2,
    seed: int = 0,
) -> StdlibCode:
    """Loads functions/methods of standard-library packages as token ids, labelled by package.

    Each example is one module-level function or one method of a module-level class (with its
    decorators) from the `.py` files of a package under `sysconfig.get_paths()["stdlib"]`
    (test directories skipped), tokenized by `tokenize_source`. The label is the package
    (`groups`). Token ids: 0 = padding, 1 = out of vocabulary, then the `vocab_size - 2` most
    frequent training tokens (ties broken alphabetically). The split is stratified per class and
    fixed by `seed`; the vocabulary sees only the training split. Lengths range from about 8 to
    more than 1000 tokens (median ~40), a long-tailed distribution that suits bucketing.
    Parsing is cached in memory per process (about one second the first time); nothing is
    written to disk.

    Args:
        vocab_size: int >= 3, default 2000. Size of the id space including pad and OOV.
        max_length: positive int or None, default 512. Longer examples are dropped (never
            truncated); None keeps all.
        min_length: positive int, default 1. Shorter examples are dropped.
        groups: sequence of str, default `DEFAULT_STDLIB_GROUPS` (asyncio, email, importlib,
            multiprocessing, unittest, xml). Package names (directories of the stdlib); each
            becomes a class, in the given order.
        validation_split: float in (0, 1), default 0.2. Share of each class held out.
        seed: int, default 0. Seed of the split and of the order of the examples.

    Returns:
        A `StdlibCode` with ragged `x_train`/`x_val` lists of int32 arrays, int32 labels,
        names, the vocabulary and the class names.

    Raises:
        ValueError: on invalid arguments or a group that is not a stdlib package or has no
            examples.

    Example:

    >>> data = load_stdlib_code(vocab_size=1000, max_length=256)
    >>> ds = kf.data.sequences_to_dataset(data.x_train, data.y_train)
    >>> batches = kf.data.bucket_by_length(ds, tokens_per_batch=4096)
    """
    vocab_size = _validation.check_int(
        "vocab_size",
        vocab_size,
        minimum=3,
        requirement="an integer >= 3 (pad, OOV and at least one token)",
    )
    max_length = _validation.check_int(
        "max_length", max_length, minimum=1, allow_none=True, requirement="a positive integer"
    )
    min_length = _validation.check_int("min_length", min_length, minimum=1)
    if max_length is not None and max_length < min_length:
        raise ValueError(
            "`max_length` must be >= `min_length`. "
            f"Received: max_length={max_length}, min_length={min_length}"
        )
    if not _validation.is_real(validation_split) or not 0.0 < validation_split < 1.0:
        raise ValueError(
            "`validation_split` must be a float strictly between 0 and 1. "
            f"Received: validation_split={validation_split!r}"
        )
    seed = _validation.check_int("seed", seed)
    if isinstance(groups, str) or not groups or not all(isinstance(g, str) for g in groups):
        raise ValueError(
            f"`groups` must be a non-empty list of package names. Received: groups={groups!r}"
        )
    groups = tuple(groups)
    if len(set(groups)) != len(groups):
        raise ValueError(f"`groups` must not repeat a package. Received: groups={list(groups)}")
    root = sysconfig.get_paths()["stdlib"]
    for group in groups:
        if not (
            os.path.isdir(os.path.join(root, group))
            or os.path.isfile(os.path.join(root, group + ".py"))
        ):
            raise ValueError(
                f"Every entry of `groups` must be a standard-library package under {root}. "
                f"Received: groups={list(groups)} ({group!r} not found)"
            )

    units = [
        u
        for u in _parse_groups(root, groups)
        if len(u[2]) >= min_length and (max_length is None or len(u[2]) <= max_length)
    ]
    labels = np.array([u[0] for u in units], dtype=np.int32)
    for i, group in enumerate(groups):
        if not np.any(labels == i):
            raise ValueError(
                f"Group {group!r} has no function of length {min_length}..{max_length}. "
                f"Received: groups={list(groups)}"
            )

    rng = np.random.default_rng(seed)
    train_idx, val_idx = [], []
    for i in range(len(groups)):
        members = rng.permutation(np.flatnonzero(labels == i))
        n_val = max(1, int(round(validation_split * members.size)))
        n_val = min(n_val, members.size - 1) if members.size > 1 else 0
        val_idx.append(members[:n_val])
        train_idx.append(members[n_val:])
    train_idx = rng.permutation(np.concatenate(train_idx))
    val_idx = rng.permutation(np.concatenate(val_idx))

    counts = collections.Counter(tok for i in train_idx for tok in units[i][2])
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
    vocab = _SPECIAL_TOKENS + tuple(tok for tok, _ in ranked)
    ids = {tok: i for i, tok in enumerate(vocab)}

    def encode(indices):
        return [
            np.array([ids.get(tok, OOV_ID) for tok in units[i][2]], dtype=np.int32) for i in indices
        ]

    return StdlibCode(
        x_train=encode(train_idx),
        y_train=labels[train_idx],
        x_val=encode(val_idx),
        y_val=labels[val_idx],
        names_train=tuple(units[i][1] for i in train_idx),
        names_val=tuple(units[i][1] for i in val_idx),
        vocab=vocab,
        class_names=groups,
        python_version=".".join(str(v) for v in sys.version_info[:3]),
    )
