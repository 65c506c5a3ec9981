"""Start-up checks of input paths, and local-only loading of Hugging Face files.

Why check first: a missing model directory used to reach `from_pretrained`, which takes a
path that does not exist for a model-hub repo id, retries the hub (or fails its repo-id
validation) and prints a long traceback — after minutes, when the learner had already loaded
its model before looking at its data. Every service now checks every path it was given before
any heavy loading and fails with one line naming the config key and the path; the `forage`
command turns `InputPathError` (a `ConfigError`) into that line on stderr and exit code 2, the
exit code of every configuration error (services/cli.py), which the launcher does not restart.

Why local-only: Forage never downloads a model (README "Set-up"). `LOCAL_ONLY` is passed to
every `from_pretrained`, so a bad path is an error and never a network call, whatever
HF_HUB_OFFLINE says.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from services.common.config import ConfigError

# Keyword arguments for every transformers / sentence-transformers `from_pretrained`.
LOCAL_ONLY: dict[str, bool] = {"local_files_only": True}

# Files of which a tokenizer directory has at least one (fast tokenizer, its config, or the
# vocabulary of a slow BPE / WordPiece / SentencePiece tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "tokenizer.model")


class InputPathError(ConfigError):
    """An input path that is unset, missing, or not what the key names; one line, key first."""


def require_set(value: str | None, key: str, what: str) -> str:
    if not value:
        raise InputPathError(f"{key} is not set ({what})")
    return value


def _shown(path: Path) -> str:
    """The path as given, and where a relative one points (the service's working directory is
    often not the one the user thinks of, e.g. in a container)."""
    return str(path) if path.is_absolute() else f"{path} (= {Path.cwd() / path})"


def require_dir(path: str | os.PathLike[str] | None, key: str, what: str = "a directory",
                contains: Iterable[str] = ()) -> Path:
    """`path` as a Path if it is a directory holding at least one of `contains` (if given)."""
    target = Path(require_set(None if path is None else str(path), key, what)).expanduser()
    if not target.exists():
        raise InputPathError(f"{key}: {_shown(target)} does not exist ({what})")
    if not target.is_dir():
        raise InputPathError(f"{key}: {_shown(target)} is not a directory ({what})")
    names = tuple(contains)
    if names and not any((target / name).is_file() for name in names):
        raise InputPathError(f"{key}: {_shown(target)} has no {' or '.join(names)} "
                             f"(not {what})")
    return target


def require_file(path: str | os.PathLike[str] | None, key: str, what: str = "a file") -> Path:
    target = Path(require_set(None if path is None else str(path), key, what)).expanduser()
    if not target.exists():
        raise InputPathError(f"{key}: {_shown(target)} does not exist ({what})")
    if not target.is_file():
        raise InputPathError(f"{key}: {_shown(target)} is not a file ({what})")
    return target


def require_model_dir(path: str | os.PathLike[str] | None, key: str = "model.path") -> Path:
    """A directory written by `save_pretrained` (it has a config.json)."""
    return require_dir(path, key, "a Hugging Face model directory", contains=("config.json",))


def require_tokenizer_dir(path: str | os.PathLike[str] | None,
                          key: str = "model.tokenizer_path") -> Path:
    return require_dir(path, key, "a Hugging Face tokenizer directory", contains=TOKENIZER_FILES)


def require_files(paths: Iterable[str], key: str, what: str = "a file") -> list[Path]:
    """Every entry of a list-valued key (e.g. data.train_files); the message names the entry."""
    return [require_file(path, f"{key}[{index}]", what) for index, path in enumerate(paths)]


def tokenizer_source(tokenizer_path: str | None, model_path: str | None,
                     tokenizer_key: str = "model.tokenizer_path",
                     model_key: str = "model.path") -> tuple[str, str | None]:
    """(config key, path) of the tokenizer: its own key if set, else the model directory."""
    if tokenizer_path:
        return tokenizer_key, tokenizer_path
    return model_key, model_path


def check_parquet_columns(path: Path, key: str, columns: Iterable[str]) -> None:
    """A readable parquet file with `columns` (only the footer is read, so this is cheap)."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(str(path)).names
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise InputPathError(f"{key}: {path} is not a readable parquet file ({exc})") from None
    missing = [c for c in columns if c not in names]
    if missing:
        raise InputPathError(f"{key}: {path} has no column(s) {', '.join(missing)} "
                             f"(has: {', '.join(names)})")
