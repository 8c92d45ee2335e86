"""Throughput, MFU and memory, written to the console, `<run_dir>/metrics.jsonl`, TensorBoard (`<run_dir>/tb/`) and,
with `log.wandb`, Weights & Biases.

    tokens/s        = tokens per step / wall time per step (all devices), over the steps between two log lines
                      (from one step's completion to another's; evaluation and checkpoint saves left out)
    TFLOP/s/device  = llama.flops_per_token * tokens/s / n_devices / 1e12
    MFU             = TFLOP/s/device / peak dense bf16 TFLOP/s of the device

The peak is `log.peak_tflops` when set, else the datasheet dense (no sparsity) bf16 figure for the device kind
below; on a device not in the table (the CPU, say) MFU is null in metrics.jsonl and off the console line, and the
log says why. fp8 recipes are still measured against the bf16 peak, as TorchTitan does, so MFU stays comparable
across recipes.
Memory is the device allocator's `bytes_in_use` / `peak_bytes_in_use` of the first local device, where the
backend reports it.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any

import jax

from mx_jax.config import ConfigError

# Dense bf16 tensor-core peaks in TFLOP/s from NVIDIA datasheets; the first key found in device_kind wins.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
)


def device_peak_tflops(configured: float) -> tuple[float | None, str]:
    """(peak TFLOP/s per device or None, where the number came from)."""
    if configured > 0:
        return configured, "log.peak_tflops"
    kind = jax.devices()[0].device_kind
    for key, peak in PEAK_BF16_TFLOPS:
        if key in kind:
            return peak, f"datasheet dense bf16 peak of {kind}"
    return None, f"no known peak for device kind '{kind}' (set log.peak_tflops to get MFU)"


def memory_in_use() -> dict[str, float]:
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {}
    if "bytes_in_use" in stats:
        out["mem_gib"] = stats["bytes_in_use"] / 2**30
    if "peak_bytes_in_use" in stats:
        out["peak_mem_gib"] = stats["peak_bytes_in_use"] / 2**30
    return out


class TensorBoard:
    """Scalars to TensorBoard event files through tensorboard's own writer (no TensorFlow needed)."""

    def __init__(self, logdir: pathlib.Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(str(logdir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        s = self._summary_pb2
        summary = s.Summary(value=[s.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()
                                   if isinstance(v, (int, float)) and math.isfinite(v)])
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def require_wandb():
    """The wandb module, or a ConfigError naming log.wandb (checked before a run writes anything)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("config key 'log.wandb': logging to Weights & Biases needs the `wandb` package (pip install "
                          "wandb, or mx_jax[wandb])")
    return wandb


class WandB:
    """Scalars to a Weights & Biases run of `project`, named after the run directory. Its id is kept in
    run_dir/wandb_id, so a resumed run logs on into the same W&B run (W&B keeps the first record of a step logged
    twice: the steps an interrupted run took after its last checkpoint)."""

    def __init__(self, run_dir: pathlib.Path, project: str, config: dict):
        wandb = require_wandb()
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: W&B makes one
        try:
            self._run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow",
                                   dir=str(run_dir), config=config)
        except Exception as e:  # wandb's UsageError, CommError, AuthenticationError
            raise ConfigError(f"config key 'log.wandb': W&B did not start the run ({type(e).__name__}: {e}); log in "
                              f"with `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline to keep the run "
                              f"under {run_dir / 'wandb'} and `wandb sync` it later") from e
        if run_id is None:
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(self._run.id + "\n")
            tmp.replace(id_file)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log({k: v for k, v in values.items() if not (isinstance(v, float) and not math.isfinite(v))},
                      step=step)

    def close(self) -> None:
        self._run.finish()


def _drop_after(path: pathlib.Path, step: int) -> None:
    """Rewrite a metrics.jsonl without the records of steps after `step` (and a torn last line), atomically."""
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{x}\n" for x in keep))
    tmp.replace(path)


class MetricsWriter:
    """One JSON object per logged step in metrics.jsonl, the same scalars to TensorBoard and W&B (`wandb`: the
    project, "" = off; `config`: the run's, for W&B). Only process 0 writes."""

    def __init__(self, run_dir: pathlib.Path, tensorboard: bool, resumed_at: int | None = None, wandb: str = "",
                 config: dict | None = None):
        """resumed_at: the step a resumed run restarts from; records of later steps (written by the interrupted run
        after its last checkpoint, and about to be written again) are dropped from metrics.jsonl first."""
        self.enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        if wandb:
            self._wandb = WandB(run_dir, wandb, config or {})
        path = run_dir / "metrics.jsonl"
        if resumed_at is not None and path.is_file():
            _drop_after(path, resumed_at)
        self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            self._tb = TensorBoard(run_dir / "tb")

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # None (e.g. mfu without a known peak) and non-finite floats are written as null: the file stays JSON.
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in values.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        flat = {}
        for k, v in values.items():
            if isinstance(v, list):  # a vector (per-expert load): one scalar per entry
                flat.update({f"{k}/{i}": x for i, x in enumerate(v)})
            elif v is not None:
                flat[k] = v
        if self._tb is not None:
            self._tb.scalars(step, flat)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.scalars(step, flat)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.close()


class Throughput:
    """Wall-clock rate over a window of steps, and the time the loop waited for their batches (`data_ms` per step:
    near zero while the data.prefetch thread builds batches faster than the steps run).

    A window runs from one step's completion to a later step's. The loop sees a step done when a read of its loss
    returns; at a window's edge it waits for the step before dispatching the next one, so no device time of a later
    step falls before the edge (a read after the next dispatch can return late, when the host is slow, e.g. while a
    checkpoint is written in the background). `start` opens a window at an edge, `step` counts each step after it,
    and `report` closes the window and opens the next one at the same instant, so every second between two edges is
    counted, whatever the host does in between (a log line, an all-gather of the data times across processes).
    The loop opens a new window after evaluation and checkpoint saves, which are not steps.
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, n_devices: int, peak_tflops: float | None):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.n_devices, self.peak = n_devices, peak_tflops
        self.start()

    def start(self, now: float | None = None) -> None:
        """Open a window at `now` (a time.perf_counter() reading; default: this call)."""
        self._t0, self._steps, self._data = time.perf_counter() if now is None else now, 0, 0.0

    def step(self, data_s: float = 0.0) -> None:
        self._steps += 1
        self._data += data_s

    def report(self, now: float | None = None) -> dict[str, float]:
        """Close the window at `now` (default: this call) and open the next one there."""
        now = time.perf_counter() if now is None else now
        dt = now - self._t0
        if self._steps == 0 or dt <= 0:
            self.start(now)
            return {}
        tps = self.tokens_per_step * self._steps / dt
        tflops = self.flops_per_token * tps / self.n_devices / 1e12
        out = {"tokens_per_sec": tps, "tflops_per_device": tflops, "step_time_s": dt / self._steps,
               "mfu": tflops / self.peak if self.peak else None, "data_ms": 1000 * self._data / self._steps}
        self.start(now)
        return out
