"""Orbax checkpoints: async save that barely pauses training, restore onto any mesh, never a half-written step.

Layout: `<run_dir>/checkpoints/<step>/{state,data}` with `state` the train state (params, optimizer state, step)
and `data` the iterator position as JSON. A save is two phases:
  1. blocking: Orbax copies the device arrays to host memory (the loop waits for this);
  2. background: a thread writes the files into `<step>.orbax-checkpoint-tmp-<time>/` and renames the directory to
     `<step>/` only when every file is written (an atomic rename on a POSIX filesystem).
A process killed in phase 2 leaves only a tmp directory, which `all_steps()` never reports and the next manager
removes (cleanup_tmp_directories), so resuming always starts from the last committed step.

Restore takes the target's shapes, dtypes and shardings from `jax.ShapeDtypeStruct`s built on the current mesh,
so a checkpoint written on one mesh restores on another (Orbax reshards on load).

Timing: the blocking phase is timed around `save()`; the background phase (write + commit) is the duration
Orbax reports for its save thread through `jax.monitoring` (same event name in orbax 0.12.4 to 0.12.8).
"""

from __future__ import annotations

import pathlib
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

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


class Checkpointer:
    def __init__(self, run_dir: str | pathlib.Path, cfg: CkptConfig):
        _install_listener()
        self.dir = pathlib.Path(run_dir).absolute() / "checkpoints"
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.dir, options=options, item_names=("state", "data"))
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
        """Start an async save; returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
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

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """abstract_state: a pytree of jax.ShapeDtypeStruct carrying the wanted shardings."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
