"""Keep a command's stdout for its result.

`forage model init` and `forage data synth` print one JSON document on stdout for scripts to
parse. The libraries they load write there too: with `accelerate` installed, transformers
imports DeepSpeed, whose logger prints "[WARNING] ... Setting accelerator to CPU" to stdout
(measured with accelerate 1.15.0, DeepSpeed 0.19.8), and C extensions can print from native
code. `result_stdout` points file descriptor 1 at stderr while the work runs (so Python and
native writes alike go there) and restores it for the result.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def result_stdout() -> Iterator[None]:
    """Inside: whatever is written to stdout (Python or native) goes to stderr. After: stdout
    is the real one again, for the command's result."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
    finally:
        os.close(saved)
