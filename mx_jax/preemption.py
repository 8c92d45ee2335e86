"""Stop on SIGTERM with a checkpoint: what a cluster scheduler's preemption or time limit needs.

SLURM (`--signal=TERM@300`, as launch/slurm.sbatch asks, preemption, `scancel`) and Kubernetes send SIGTERM and kill
the job a grace period later. Without a handler Python dies at once and the run loses every step since its last
checkpoint. With one, the loop asks `reached(step)` after each step it dispatches; the first step at which it is
True is saved (even off the `ckpt.every_steps` schedule), the loop stops, every save in flight is committed, and
`python -m mx_jax.train` exits with `EXIT_CODE` (143 = 128 + SIGTERM, what a shell reports for a process SIGTERM
ended). Running the same command again resumes from that step.

All processes of a multi-host run must save the *same* step, but the signal reaches them at different times (or
only one of them). There jax's preemption service agrees on it: `jax.distributed.initialize` installs its own
SIGTERM handler in every process, a notice on any process reaches all of them through the coordination service,
and `multihost_utils.reached_preemption_sync_point(step)` is True on every process at the same step (the largest
step any process had reached, plus one). That needs every process to call it at every step from a common start,
which the loop does. One process: a Python handler that sets a flag.
"""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils

EXIT_CODE = 128 + signal.SIGTERM


class PreemptionWatch:
    """`reached(step)`: stop after this step? Install with `with PreemptionWatch() as watch:`."""

    def __init__(self) -> None:
        self.multi_process = jax.process_count() > 1
        self.note = ""  # why SIGTERM cannot be handled, if it cannot
        self._signalled = False
        self._previous = None

    def __enter__(self) -> "PreemptionWatch":
        if self.multi_process:  # jax's preemption service holds SIGTERM; a Python handler would take it away
            if not jax.config.jax_enable_preemption_service:
                self.note = "jax's preemption service is off (jax_enable_preemption_service=False)"
        elif threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        else:
            self.note = "training runs outside the main thread, where Python cannot handle SIGTERM"
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def reached(self, step: int) -> bool:
        if not self.multi_process:
            return self._signalled
        if self.note:
            return False
        return multihost_utils.reached_preemption_sync_point(step)
