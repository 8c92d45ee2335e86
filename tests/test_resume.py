"""Checkpoint/resume: bitwise-equal continuation, and no half-written step after a SIGKILL mid-save."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np

from mx_jax import train
from tests.helpers import TINY, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_resume_is_bitwise_identical(tmp_path):
    straight = train.train(tiny_config(tmp_path / "a", "steps=6", "mesh.fsdp=2", "mesh.data=4"))
    train.train(tiny_config(tmp_path / "b", "steps=3", "mesh.fsdp=2", "mesh.data=4"))
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["3"]
    resumed = train.train(tiny_config(tmp_path / "b", "steps=6", "mesh.fsdp=2", "mesh.data=4"))
    assert int(resumed.state["step"]) == 6
    for a, b in zip(_leaves(straight.state), _leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: same batches, same compiled step
    assert straight.metrics["loss"] == resumed.metrics["loss"]


def test_bf16_weight_copies_follow_the_masters_and_resume_bitwise(tmp_path):
    """The state's compute-dtype GEMM weights are the cast of the masters the same step wrote (not of the previous
    ones), are not checkpointed, and are cast again on restore: a resumed bf16 run equals the straight one."""
    over = ("model.compute_dtype=bfloat16", "mesh.fsdp=2", "mesh.data=4")
    straight = train.train(tiny_config(tmp_path / "a", "steps=4", *over))
    params, copies = straight.state["params"], straight.state["compute"]
    assert sorted(copies["blocks"]["mlp"]) == ["w_down", "w_gate", "w_up"] and "embed" not in copies
    for path, c in jax.tree_util.tree_leaves_with_path(copies):
        p = params
        for k in path:
            p = p[k.key]
        assert c.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(c), np.asarray(p.astype(c.dtype)))
    train.train(tiny_config(tmp_path / "b", "steps=2", *over))
    resumed = train.train(tiny_config(tmp_path / "b", "steps=4", *over))
    for a, b in zip(_leaves(straight.state), _leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_never_refuses_to_overwrite(tmp_path):
    train.train(tiny_config(tmp_path, "steps=2", "mesh.fsdp=1", "mesh.data=8"))
    rc = train.main([*TINY, f"run_dir={tmp_path}", "steps=4", "ckpt.resume=never"])
    assert rc == 2
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # nothing touched


# The child process slows Orbax's final rename (the commit) so the kill lands while a save is in flight.
_CHILD = textwrap.dedent("""
    import asyncio, sys, time
    from orbax.checkpoint._src.path import atomicity
    original = atomicity.AtomicRenameTemporaryPath.finalize
    async def slow_finalize(self, *args, **kwargs):
        if "/4." in str(self.get()) or str(self.get()).endswith("/4"):
            print("SLOW_COMMIT_STARTED", flush=True)
            await asyncio.sleep(60)
        return await original(self, *args, **kwargs)
    atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize
    from mx_jax import train
    sys.exit(train.main(sys.argv[1:]))
""")


def test_sigkill_during_async_save_resumes_from_last_commit(tmp_path):
    args = [*TINY, f"run_dir={tmp_path}", "steps=6", "ckpt.every_steps=2", "mesh.fsdp=1", "mesh.data=1"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    deadline = time.time() + 240
    try:
        for line in proc.stdout:
            lines.append(line)
            if "SLOW_COMMIT_STARTED" in line:
                break
            assert time.time() < deadline, "".join(lines)
        else:
            raise AssertionError("child ended before the save of step 4 began:\n" + "".join(lines))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    ckpt_dir = tmp_path / "checkpoints"
    names = sorted(os.listdir(ckpt_dir))
    committed = [n for n in names if n.isdigit()]
    assert "2" in committed and "4" not in committed, names
    assert any(n.startswith("4.orbax-checkpoint-tmp") for n in names), names  # the in-flight save, uncommitted
    # Resume: starts from step 2, cleans the tmp directory away, and reaches step 6.
    result = train.train(tiny_config(tmp_path, "steps=6", "ckpt.every_steps=2", "mesh.fsdp=1", "mesh.data=1"),
                         devices=jax.devices()[:1])
    assert int(result.state["step"]) == 6
    after = sorted(os.listdir(ckpt_dir))
    assert not any("tmp" in n for n in after), after
    assert {"4", "6"} <= set(after)
    first_resumed = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r["step"] for r in first_resumed]
    assert steps_logged.count(3) == 2  # step 3 ran before the kill and again after resuming from 2
