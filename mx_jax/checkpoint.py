"""Orbax checkpoints: async save that barely pauses training, restore onto any mesh, never a half-written step.

Layout: `<run_dir>/checkpoints/<step>/{state,data}` with `state` the train state (params, optimizer state, step, and
a MoE model's router biases; not the compute copies, which are made again from the params) and `data` the iterator
position as JSON. A save is two phases:
  1. blocking: Orbax copies the device arrays to host memory (the loop waits for this);
  2. background: a thread writes the files into `<step>.orbax-checkpoint-tmp-<time>/` and renames the directory to
     `<step>/` only when every file is written (an atomic rename on a POSIX filesystem).
A process killed in phase 2 leaves only a tmp directory, which `all_steps()` never reports and the next manager
removes (cleanup_tmp_directories), so resuming always starts from the last committed step.

Restore takes the target's shapes, dtypes and shardings from `jax.ShapeDtypeStruct`s built on the current mesh,
so a checkpoint written on one mesh restores on another (Orbax reshards on load).

Restore checks before it reads any array: the step's `data` item records the seed, data settings and model config
it was trained with, and its Orbax metadata records every array's shape; a run whose config no longer matches gets
a ConfigError naming the keys and arrays, and a step directory Orbax cannot read gets a CheckpointError naming it.

Timing: the blocking phase is timed around `save()`; the background phase (write + commit) is the duration
Orbax reports for its save thread through `jax.monitoring` (same event name in orbax 0.12.4 to 0.12.8). Orbax
finishes one save before it starts the next, so a save due before the previous one is written waits for it: that
wait is reported apart. On a GPU the copy to host goes through pinned host memory at ~40 GB/s (0.17 s for 7.2 GB on
an H100 host), except in a process's first save, which also allocates that memory (4-7 s for 7.2 GB). Allocating it
ahead was tried and dropped: during the compile it slowed the compile as much, after it the first steps
(benchmarks/RESULTS.md, "Checkpoint pauses").
"""

from __future__ import annotations

import logging
import pathlib
import sys
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from mx_jax import compat
from mx_jax.config import CkptConfig, ConfigError

_BACKGROUND_EVENT = "/jax/checkpoint/write/async/thread_duration_sec"
_background_lock = threading.Lock()
_background_durations: list[float] = []
_listener_installed = False


def _install_listener() -> None:
    global _listener_installed
    if _listener_installed:
        return

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == _BACKGROUND_EVENT:
            with _background_lock:
                _background_durations.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    _listener_installed = True


class CheckpointError(RuntimeError):
    """A checkpoint on disk cannot be read or written; the message names the step directory."""


def read_failure(err: BaseException) -> str:
    """'ValueError: OUT_OF_RANGE: Error reading "params.wq/0.0" ...' for an exception Orbax raised reading a step.

    Orbax wraps TensorStore's error (which names the array and file) in a generic Exception whose message ends in
    the array's whole TensorStore spec, so the first cause in the chain that says more is quoted, its first line,
    without that spec."""
    chain = [err]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    said = [(e, str(e).strip().split("See full TensorStore details")[0].strip().splitlines()) for e in chain]
    e, lines = next(((e, l) for e, l in reversed(said) if l), (err, [""]))
    return f"{type(e).__name__}: {lines[0][:400]}"


def _from_orbax_read(text: str) -> bool:
    return any(k in text for k in ("orbax/checkpoint", "OCDBT", "TensorStore"))


class _AbandonedReads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("exception was never retrieved" in text.split("\n", 1)[0] and _from_orbax_read(text))


def quiet_abandoned_reads() -> None:
    """Keep a failed restore's report to the one error that names the step (idempotent; before restoring).

    Orbax reads each array in its own asyncio tasks and stops at the first failure. The others' exceptions are then
    never retrieved: asyncio logs each task's and future's (gathered or not), and Python reports each abandoned
    coroutine's as unraisable, every one with the array's whole TensorStore spec (hundreds of lines after the
    message that matters); reads still in flight when Orbax closed its event loop end in "Event loop is closed" inside
    TensorStore's callbacks, also unraisable. Those reports are dropped; every other one passes."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReads) for f in logger.filters):
        logger.addFilter(_AbandonedReads())
    if getattr(sys.unraisablehook, "_drops_abandoned_reads", False):
        return
    previous = sys.unraisablehook

    def hook(u):
        closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
        code = getattr(u.object, "cr_code", None)
        if not (closed or (code is not None and _from_orbax_read(code.co_filename + str(u.exc_value)))):
            previous(u)

    hook._drops_abandoned_reads = True
    sys.unraisablehook = hook


def _path_name(path) -> str:
    """'params.blocks.attn.wq' for a jax tree path (dict keys, sequence indices and namedtuple fields alike)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def array_shapes(tree: Any) -> dict[str, tuple]:
    """{'params.blocks.attn.wq': shape, ...} for a tree of arrays, ShapeDtypeStructs or Orbax array metadata."""
    return {_path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def shape_mismatches(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
    """Differences between two {array name: shape} maps, one line each (reshaped, missing, unexpected); the
    parameters' lines first, as they name the model change (the optimizer moments repeat them)."""
    out = [f"{k}: {saved[k]} in the checkpoint, {wanted[k]} in this model" for k in wanted
           if k in saved and tuple(saved[k]) != tuple(wanted[k])]
    out += [f"{k}: in this model, not in the checkpoint" for k in wanted if k not in saved]
    out += [f"{k}: in the checkpoint, not in this model" for k in saved if k not in wanted]
    return sorted(out, key=lambda line: not line.startswith("params."))


class _Manager(ocp.CheckpointManager):
    """Orbax's manager without its own preemption checks. It asks jax's preemption service from `save` and from its
    finalize thread, with the step being saved; the service takes the step a process last asked about as the step it
    has reached, so a finalize thread asking about an older step could make the processes agree on a step this one
    has already passed (mx_jax/preemption.py). The train loop asks, once per step."""

    def reached_preemption(self, step: int) -> bool:
        return False


class Checkpointer:
    def __init__(self, run_dir: str | pathlib.Path, cfg: CkptConfig):
        _install_listener()
        quiet_abandoned_reads()
        self.dir = pathlib.Path(run_dir).absolute() / "checkpoints"
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"config key 'run_dir': {self.dir} exists and is not a directory")
        self.manager = _Manager(
            self.dir, options=options, item_names=("state", "data"),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})
        self._closed = False
        self.waited_s = 0.0  # of the last save(): waiting for the previous save's background write
        self._pending: list[tuple[int, float]] = []  # (step, blocking seconds) of saves not yet reported

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def resume_step(self) -> int | None:
        """The step to restore per `ckpt.resume`, or None to start fresh. Errors rather than overwrite saves."""
        steps = self.all_steps()
        if self.cfg.resume == "never":
            if steps:
                raise ConfigError(
                    f"config key 'ckpt.resume': {self.dir} already holds checkpoints {steps}; starting fresh would "
                    f"overwrite them. Use ckpt.resume=latest, a step number, or a new run_dir")
            return None
        if self.cfg.resume == "latest":
            return steps[-1] if steps else None
        step = int(self.cfg.resume)
        if step not in steps:
            raise ConfigError(f"config key 'ckpt.resume': no committed checkpoint for step {step} in {self.dir} "
                              f"(have {steps or 'none'})")
        later = [s for s in steps if s > step]
        if later:
            raise ConfigError(
                f"config key 'ckpt.resume': checkpoints after step {step} exist ({later}); resuming from {step} "
                f"would overwrite them. Move them away or copy step {step} into a new run_dir")
        return step

    def save(self, step: int, state: Any, data_state: dict) -> float:
        """Start an async save; returns the seconds the caller was blocked (`waited_s` of them waiting for the
        previous save's background write, which Orbax finishes before it starts another)."""
        t0 = time.perf_counter()
        self.manager.wait_until_finished()
        self.waited_s = time.perf_counter() - t0
        started = self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
        if not started:  # Orbax skips a step it already has, or one below its latest: never silently
            raise CheckpointError(f"Orbax declined to save step {step} in {self.dir} (committed steps: "
                                  f"{self.all_steps()}); the run continues no further without its checkpoint")
        blocked = time.perf_counter() - t0
        self._pending.append((step, blocked))
        return blocked

    def finished_saves(self) -> list[tuple[int, float, float]]:
        """(step, blocking s, background s) of saves whose background phase has completed since the last call."""
        if not self.cfg.async_save:
            out, self._pending = [(s, b, 0.0) for s, b in self._pending], []
            return out
        out = []
        with _background_lock:
            while self._pending and _background_durations:
                step, blocked = self._pending.pop(0)
                out.append((step, blocked, _background_durations.pop(0)))
        return out

    def _unreadable(self, step: int, what: str, err: Exception) -> CheckpointError:
        earlier = [s for s in self.all_steps() if s < step]
        hint = (f"move {self.dir / str(step)} out of {self.dir} to resume from step {earlier[-1]}" if earlier else
                f"no earlier checkpoint exists; move {self.dir / str(step)} away to start fresh")
        return CheckpointError(f"cannot read {what} of the checkpoint at {self.dir / str(step)} "
                               f"({read_failure(err)}); {hint}")

    def data_state(self, step: int) -> dict:
        """The step's `data` item (iterator position and what the run was trained with), without its arrays."""
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 -- Orbax raises many types for a damaged directory
            raise self._unreadable(step, "the data item", e) from e
        data = restored["data"]
        if not isinstance(data, dict) or "position" not in data:
            raise self._unreadable(step, "the data item", ValueError(f"no 'position' in {data!r}"))
        return data

    def saved_shapes(self, step: int) -> dict[str, tuple]:
        """{array name: shape} of the step's state, from Orbax's metadata (reads no array)."""
        try:
            shapes = array_shapes(self.manager.item_metadata(step)["state"])
            if not shapes:
                raise ValueError("no array metadata")
            return shapes
        except Exception as e:  # noqa: BLE001
            raise self._unreadable(step, "the array metadata", e) from e

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The step's state. abstract_state: a pytree of jax.ShapeDtypeStruct carrying the wanted shardings."""
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:  # noqa: BLE001
            raise self._unreadable(step, "the arrays", e) from e
        return restored["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the saves in flight to commit, then release Orbax's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        compat.await_orbax_tmp_cleanup(self.manager)
        self.manager.wait_until_finished()
        self.manager.close()
