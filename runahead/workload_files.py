"""Workloads from real files a user has offline: ShareGPT conversations and SWE-agent trajectories.

The paper's two workloads come from these data sets (see ``shared/seeds/bevy-paper-summary.md``);
:mod:`runahead.workloads` models them synthetically. :func:`load_sharegpt` and
:func:`load_swe_agent` turn one file into :class:`~runahead.workloads.RequestSample` s (prompt and
output tokens, counted with a tokenizer when given, else :func:`estimate_tokens`);
:func:`load_trajectories` reads one trajectory or a folder of them into :class:`Turn` s, which also
say how many tokens each turn adds to the agent's context (what ``runahead bench --workload agentic
--workload-file`` prefills). A bad file names itself in a :class:`WorkloadFileError`; in a folder,
a bad file is skipped (and counted) so that it never hurts the others.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runahead.workloads import RequestSample

__all__ = [
    "LoadedSamples",
    "Tokenizer",
    "Turn",
    "WorkloadFileError",
    "estimate_tokens",
    "load_sharegpt",
    "load_swe_agent",
    "load_trajectories",
]

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """Anything with ``encode(text)`` returning a sized sequence of ids (e.g. a Hugging Face tokenizer)."""

    def encode(self, text: str) -> Any: ...


class WorkloadFileError(ValueError):
    """A workload file is missing, unreadable, not JSON, or not shaped as its format requires."""


class LoadedSamples(list[RequestSample]):
    """The samples a loader read (a plain list of :class:`RequestSample`), plus what it skipped.

    ``skipped`` counts malformed items left out (ShareGPT: conversations; SWE-agent: messages or
    steps); ``path`` is the file read.
    """

    def __init__(self, samples: Iterable[RequestSample], *, path: Path, skipped: int) -> None:
        super().__init__(samples)
        self.path = path
        self.skipped = skipped


def estimate_tokens(text: str) -> int:
    """A tokenizer-free token count: ``max(whitespace words, ceil(characters / 4))``.

    ~4 characters per token is the usual rule of thumb for English BPE vocabularies; taking the
    larger of it and the word count keeps short words and dense code from being undercounted. It is
    an estimate: pass a tokenizer to the loaders for exact counts.
    """
    return max(len(text.split()), math.ceil(len(text) / 4))


def _counter(tokenizer: Tokenizer | None) -> Any:
    if tokenizer is None:
        return estimate_tokens
    return lambda text: len(tokenizer.encode(text))


def _read_json(path: str | Path, kind: str) -> tuple[Path, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadFileError(f"{kind} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise WorkloadFileError(f"cannot read {kind} file {path}: {error}") from error
    try:
        return path, json.loads(text)
    except json.JSONDecodeError as error:
        raise WorkloadFileError(f"{kind} file {path} is not valid JSON: {error}") from error


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")


def load_sharegpt(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    limit: int | None = None,
    *,
    with_history: bool = False,
) -> LoadedSamples:
    """Requests from a ShareGPT-format JSON file: a list of ``{"id", "conversations": [...]}``.

    Each ``conversations`` item is ``{"from": "human" | "gpt" | ..., "value": str}``. Every human
    turn followed directly by a gpt turn makes one request: the human text is the prompt (with
    ``with_history``, every earlier turn of the conversation too), the gpt text the output. Other
    speakers (e.g. ``system``) only count toward history. Token counts come from
    ``tokenizer.encode`` when given, else :func:`estimate_tokens`; counts are at least 1 (a request
    generates at least one token). At most ``limit`` requests are returned.

    Malformed conversations (not a dict, no ``conversations`` list, a turn without string ``from``
    and ``value``) are skipped whole and counted in the result's ``skipped``. A missing or
    unreadable file, invalid JSON, or a top level that is not a list raises
    :class:`WorkloadFileError` naming the file. Arrivals are closed (``arrival_s=None``).
    """
    _check_limit(limit)
    path, data = _read_json(path, "ShareGPT")
    if not isinstance(data, list):
        raise WorkloadFileError(
            f"ShareGPT file {path} must hold a JSON list of conversations, got {type(data).__name__}"
        )
    count = _counter(tokenizer)
    samples: list[RequestSample] = []
    skipped = 0
    for entry in data:
        if limit is not None and len(samples) >= limit:
            break
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
            for t in turns
        ):
            skipped += 1
            continue
        history = 0
        for i, turn in enumerate(turns):
            tokens = count(turn["value"])
            following = turns[i + 1] if i + 1 < len(turns) else None
            if turn["from"] == "human" and following is not None and following["from"] == "gpt":
                prompt = tokens + (history if with_history else 0)
                output = count(following["value"])
                samples.append(RequestSample(max(1, prompt), max(1, output)))
                if limit is not None and len(samples) >= limit:
                    break
            history += tokens
    if skipped:
        log.warning("%s: skipped %d malformed conversation(s)", path, skipped)
    return LoadedSamples(samples, path=path, skipped=skipped)


def _content_text(content: Any) -> str | None:
    """A message's text: a string, or a list of parts (``str`` or ``{"text": str}``); else None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                return None
        return "\n".join(parts)
    return None


def load_swe_agent(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    limit: int | None = None,
    *,
    system_tokens: int = 0,
) -> LoadedSamples:
    """Requests from one SWE-agent trajectory JSON file (a ``.traj``): one request per agent turn.

    The file is a dict with ``"history"`` (``[{"role": "system" | "user" | "assistant" | ...,
    "content": str | [parts]}, ...]``) and/or ``"trajectory"`` (``[{"thought", "action",
    "response", "observation", ...}, ...]``). Each assistant turn is one request whose prompt is the
    whole history before it, so prompts grow along the trajectory, and whose output is that turn.

    ``history`` is used when present, since it holds every message the model saw. From
    ``trajectory`` alone the prompt is the earlier steps' responses (else thought + action) and
    observations, plus ``system_tokens`` for the system prompt and issue text the trajectory does
    not record. Token counts: as in :func:`load_sharegpt`. At most ``limit`` requests.

    Malformed messages or steps are skipped (a skipped step's text is then missing from later
    prompts) and counted in ``skipped``. A missing or unreadable file, invalid JSON, a top level
    that is not a dict, or a dict with neither list raises :class:`WorkloadFileError` naming the
    file. Arrivals are closed (``arrival_s=None``).
    """
    _check_limit(limit)
    if system_tokens < 0:
        raise ValueError(f"system_tokens must be >= 0, got {system_tokens}")
    path, data = _read_json(path, "SWE-agent trajectory")
    if not isinstance(data, dict):
        raise WorkloadFileError(
            f"SWE-agent trajectory file {path} must hold a JSON object, got {type(data).__name__}"
        )
    history, trajectory = data.get("history"), data.get("trajectory")
    count = _counter(tokenizer)
    samples: list[RequestSample] = []
    skipped = 0
    if isinstance(history, list) and history:
        context = 0
        for message in history:
            if limit is not None and len(samples) >= limit:
                break
            role = message.get("role") if isinstance(message, dict) else None
            text = _content_text(message.get("content")) if isinstance(message, dict) else None
            if not isinstance(role, str) or text is None:
                skipped += 1
                continue
            tokens = count(text)
            if role == "assistant":
                samples.append(RequestSample(max(1, context), max(1, tokens)))
            context += tokens
    elif isinstance(trajectory, list):
        context = system_tokens
        for step in trajectory:
            if limit is not None and len(samples) >= limit:
                break
            if not isinstance(step, dict):
                skipped += 1
                continue
            response = step.get("response")
            if not isinstance(response, str) or not response:
                pieces = [step.get("thought"), step.get("action")]
                response = "\n".join(p for p in pieces if isinstance(p, str))
            observation = step.get("observation")
            if not response or not isinstance(observation, str | None):
                skipped += 1
                continue
            output = count(response)
            samples.append(RequestSample(max(1, context), max(1, output)))
            context += output + (count(observation) if observation else 0)
    else:
        raise WorkloadFileError(f"SWE-agent trajectory file {path} has no 'history' or 'trajectory' list")
    if skipped:
        log.warning("%s: skipped %d malformed message(s)/step(s)", path, skipped)
    return LoadedSamples(samples, path=path, skipped=skipped)


@dataclass(frozen=True, slots=True)
class Turn:
    """One agent turn of a trajectory: its request, and the tokens it adds to the agent's context.

    ``new_tokens`` is this turn's prompt minus the previous turn's prompt in the same trajectory
    (that turn's output plus the tool's observation): what a server that keeps the agent's prefix
    in its KV cache prefills. For a trajectory's first turn it is the whole prompt.
    """

    sample: RequestSample
    new_tokens: int


def load_trajectories(
    path: str | Path, tokenizer: Tokenizer | None = None, *, system_tokens: int = 0
) -> list[Turn]:
    """Every agent turn of one SWE-agent trajectory file, or of every ``*.traj`` under a folder.

    Files are read in sorted path order, each with :func:`load_swe_agent`; a folder's file that
    cannot be read or holds no turn is skipped with a warning (one bad file never hurts the
    others). Raises :class:`WorkloadFileError` when ``path`` does not exist, when a single file is
    bad, or when a folder yields no turn at all.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("*.traj"))
        if not files:
            raise WorkloadFileError(f"folder {path} holds no SWE-agent trajectory (*.traj) file")
    elif path.exists():
        files = [path]
    else:
        raise WorkloadFileError(f"SWE-agent trajectory path {path} does not exist")
    turns: list[Turn] = []
    bad = 0
    for file in files:
        try:
            samples = load_swe_agent(file, tokenizer, system_tokens=system_tokens)
        except WorkloadFileError as error:
            if len(files) == 1:
                raise
            log.warning("skipped %s", error)
            bad += 1
            continue
        previous = 0
        for sample in samples:
            turns.append(Turn(sample, max(1, sample.prompt_tokens - previous)))
            previous = sample.prompt_tokens
    if not turns:
        raise WorkloadFileError(f"{path} holds no agent turn ({len(files)} file(s), {bad} unreadable)")
    return turns
