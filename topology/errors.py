"""tessera's errors: one small hierarchy every layer raises (it sits at the bottom of the layering, beside
the torch-free shapes, so topology, models, parallel and the runtime all import it).

    TesseraError                 anything tessera reports; `exit_code` for the CLI, `restartable` for
    |                            the launcher (does a restart from the last checkpoint have a chance?)
    +-- ConfigError              bad input: a layout, a flag, a model, a file the run cannot use (ValueError)
    |   +-- PlanError            the planner: no layout fits, a request it cannot plan
    +-- CheckpointError          a checkpoint that is damaged, incomplete or of another run (ValueError)
    +-- NonFiniteError           a NaN or inf loss or gradient: the same data would make it again
    +-- CollectiveTimeout        a collective stalled past its timeout (a rank died or hung): restartable
    +-- RankFailure              a rank raised or died: restartable unless its own error was not
    +-- RankTimeout              ranks did not finish in time: restartable

Library code raises these with messages naming parameters; the CLI maps each to its one line and exit code
(`exit_code`), and the launcher restarts by `restartable`, never by matching an error's text. The
configuration and checkpoint errors are also ValueErrors, so callers that catch ValueError keep working.
"""

from __future__ import annotations

import re
from typing import Mapping


class TesseraError(Exception):
    exit_code = 2  # a named failure: the CLI prints its one line and exits 2
    restartable = False


class ConfigError(TesseraError, ValueError):
    pass


class PlanError(ConfigError):
    pass


class CheckpointError(TesseraError, ValueError):
    pass


class NonFiniteError(TesseraError, RuntimeError):
    pass


class TesseraWarning(UserWarning):
    """What tessera warns of (a checkpoint fallback): the CLI prints it as one `tessera: warning:` line."""


class CollectiveTimeout(TesseraError, RuntimeError):
    restartable = True


class RankFailure(TesseraError, RuntimeError):
    """A rank raised or died. `restartable`: whether a restart could help (False when the rank's own error
    was bad input, a damaged checkpoint or a non-finite value, which a restart would only repeat)."""

    def __init__(self, message: str, restartable: bool = True, cause: dict | None = None):
        super().__init__(message)
        self.restartable = restartable
        # the rank's own error: {"type", "message" (its first line), "restartable", "exit_code", "tessera"}
        self.cause = cause


class RankTimeout(TesseraError, RuntimeError):
    """Ranks did not finish in time; carries the stalled ranks and where they are stuck."""

    restartable = True

    def __init__(self, message: str, stalled: dict[int, str]):
        super().__init__(message)
        self.stalled = stalled


def is_restartable(error: BaseException) -> bool:
    """Whether a restart from the last checkpoint could get past `error`: tessera's own errors say so; of
    the others, bad input (ValueError, TypeError) and a user's interrupt would only repeat, anything else (a
    backend error when a peer dies, an out-of-memory) might not."""
    if isinstance(error, TesseraError):
        return error.restartable
    return not isinstance(error, (ValueError, TypeError, KeyboardInterrupt, SystemExit))


def with_flags(message: str, flags: Mapping[str, str]) -> str:
    """A library message as the command line says it: each `name=value` of a parameter in `flags` (its name
    -> the flag, e.g. "microbatches" -> "--microbatches") written `--flag value`, and each parameter named
    without a value, in backquotes ("raise `dp` or `cp`"), written as the bare flag ("raise --dp or --cp").
    Library messages name the parameters of the Python API; the CLI calls this on the errors of the checks
    it runs, so they name its flags instead."""
    if not flags:
        return message
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    message = re.sub(rf"`({names})`", lambda m: flags[m.group(1)], message)
    return re.sub(rf"(?<![\w.-])({names})=", lambda m: flags[m.group(1)] + " ", message)
