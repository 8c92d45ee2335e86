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
import pytest

from mx_jax import train
from tests.helpers import NO_EVAL, NO_IO, TINY, tiny_config, xla_flags

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
    ones), are not checkpointed, and are cast again on restore: a resumed bf16 run equals the straight one.
    The same checkpoint (float32 AdamW moments) then resumes with optim.moment_dtype=bfloat16: its moments are
    restored rounded, stay bf16 in the sharded step, and the run continues close to the float32 one (the step's
    arithmetic is float32 either way)."""
    over = ("model.compute_dtype=bfloat16", "mesh.fsdp=2", "mesh.data=4")
    straight = train.train(tiny_config(tmp_path / "a", "steps=4", *over, *NO_IO))
    params, copies = straight.state["params"], straight.state["compute"]
    assert sorted(copies["blocks"]["mlp"]) == ["w_down", "w_gate", "w_up"] and "embed" not in copies
    for path, c in jax.tree_util.tree_leaves_with_path(copies):
        p = params
        for k in path:
            p = p[k.key]
        assert c.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(c), np.asarray(p.astype(c.dtype)))
    train.train(tiny_config(tmp_path / "b", "steps=2", *over, NO_EVAL))  # its checkpoint: kept
    resumed = train.train(tiny_config(tmp_path / "b", "steps=4", *over, *NO_IO))
    for a, b in zip(_leaves(straight.state), _leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["2"]
    bf16_moments = train.train(tiny_config(tmp_path / "b", "steps=4", "optim.moment_dtype=bfloat16", *over, *NO_IO))
    adam = bf16_moments.state["opt_state"][1][0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype("bfloat16")}
    for a, b in zip(_leaves(straight.state["params"]), _leaves(bf16_moments.state["params"]), strict=True):
        # Adam moves a weight by up to ~lr = 1e-3 a step; moments lost on restore would show at that size.
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert abs(straight.metrics["loss"] - bf16_moments.metrics["loss"]) < 1e-3 * straight.metrics["loss"]


def test_resume_never_refuses_to_overwrite(tmp_path):
    train.train(tiny_config(tmp_path, "steps=2", "mesh.fsdp=1", "mesh.data=8"))
    rc = train.main([*TINY, f"run_dir={tmp_path}", "steps=4", "ckpt.resume=never"])
    assert rc == 2
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # nothing touched


def test_resume_of_a_missing_step_writes_nothing(tmp_path, capsys):
    """ckpt.resume=N without a checkpoint of step N: exit 2 naming the key, and no run directory made (a new one) or
    touched (one holding other steps)."""
    rc = train.main([*TINY, f"run_dir={tmp_path / 'new'}", "steps=4", "ckpt.resume=3"])
    assert rc == 2 and not (tmp_path / "new").exists()
    assert "config key 'ckpt.resume': no checkpoint for step 3" in capsys.readouterr().err
    train.train(tiny_config(tmp_path / "old", "steps=2", "mesh.fsdp=1", NO_EVAL), devices=jax.devices()[:1])
    before = sorted(p.name for p in (tmp_path / "old").rglob("*"))
    assert train.main([*TINY, f"run_dir={tmp_path / 'old'}", "steps=4", "ckpt.resume=3"]) == 2
    assert "(have [2])" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "old").rglob("*")) == before


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
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "PYTHONPATH": str(ROOT)}
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
    # Step 3 ran before the kill and again after resuming from 2: metrics.jsonl keeps one record per step.
    assert steps_logged == [1, 2, 3, 4, 5, 6], steps_logged


# ---------------------------------------------------------------------------------------------------------------
# What a resume refuses, and what it leaves behind when it does


def _snapshot(run_dir: pathlib.Path) -> dict:
    """Every file under run_dir but metrics/TensorBoard, with its bytes."""
    return {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*"))
            if f.is_file() and f.parts[len(run_dir.parts)] not in ("tb", "metrics.jsonl")}


def test_resume_refuses_a_different_run_and_touches_nothing(tmp_path, capsys):
    base = [*TINY, f"run_dir={tmp_path}", "ckpt.every_steps=2"]
    assert train.main([*base, "steps=2"]) == 0
    before = _snapshot(tmp_path)
    assert "config.yaml" in before and "checkpoints/2/data/metadata" in before
    for override, named in [
        ("model.d_model=128", "'model.d_model' is 64 there, 128 here"),
        ("model.rope_theta=10000", "'model.rope_theta'"),  # same shapes, another function
        ("seed=1", "'seed': the checkpoint at"),  # would change the data order
        ("data.seq_len=16", "'data.seq_len'"),
        ("steps=1", "'steps': 1, but"),  # below the committed step
    ]:
        assert train.main([*base, "steps=4", override]) == 2, override
        assert named in capsys.readouterr().err, override
        assert _snapshot(tmp_path) == before, override  # config.yaml and every checkpoint as they were
    # The run is complete at steps=2: a rerun (a requeued job) trains nothing, succeeds, and keeps its config.yaml.
    assert train.main([*base, "steps=2", "optim.lr_peak=0.5"]) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert _snapshot(tmp_path) == before
    # How the same function is computed may change: remat, scan, compute dtype, and the documents kept apart per
    # attention block (model.max_documents: from the data, per chunk under context parallelism, so a resume on
    # another mesh.context sets another).
    assert train.main([*base, "steps=4", "model.remat=full", "model.scan_layers=false", "model.max_documents=4"]) == 0
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


@pytest.mark.parametrize("before, after", [("1.0", "0"), ("0", "1e30")], ids=["off", "on"])
def test_gradient_clipping_may_be_turned_on_or_off_on_resume(tmp_path, capsys, before, after):
    """optim.grad_clip_norm between 0 and a positive bound moves AdamW's state one place along the optimizer chain
    (the clipping's state holds no arrays). The resume restores it under the checkpoint's layout and moves it: the
    step after it is that of a resume which keeps the checkpoint's layout with the same effect (a bound of 1e30 never
    clips; 0 has no clipping at all): the same loss and gradient norm, and the same update up to float32 rounding
    (the two programs fuse AdamW differently). Restarted moments would move the weights by ~lr, not by 1e-9."""
    import shutil

    over = ("ckpt.every_steps=2", "mesh.fsdp=1", NO_EVAL)

    def run(name, *more):
        return train.train(tiny_config(tmp_path / name, *over, *more), devices=jax.devices()[:1])

    run("a", "steps=2", f"optim.grad_clip_norm={before}")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    toggled = run("a", "steps=3", f"optim.grad_clip_norm={after}")
    assert f"resume | gradient clipping turned {'off' if after == '0' else 'on'}" in capsys.readouterr().out
    kept = run("b", "steps=3", f"optim.grad_clip_norm={'1e30' if after == '0' else '0'}")
    assert "gradient clipping turned" not in capsys.readouterr().out
    for key in ("loss", "grad_norm"):
        assert toggled.metrics[key] == kept.metrics[key], key
    for x, y in zip(jax.tree.leaves(toggled.state["params"]), jax.tree.leaves(kept.state["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    adam = lambda st: next(s for s in jax.tree.leaves(st["opt_state"], is_leaf=lambda s: hasattr(s, "mu"))  # noqa
                           if hasattr(s, "mu"))
    assert int(adam(toggled.state).count) == 3  # AdamW's moments continued, not restarted
    for x, y in zip(jax.tree.leaves(adam(toggled.state).nu), jax.tree.leaves(adam(kept.state).nu), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-12)


def test_checkpoint_without_a_model_record_is_checked_by_shapes(tmp_path, capsys):
    """Checkpoints written before the data item recorded the model: Orbax's array metadata still pins the shapes."""
    base = [*TINY, f"run_dir={tmp_path}", "ckpt.every_steps=2"]
    assert train.main([*base, "steps=2"]) == 0
    item = tmp_path / "checkpoints" / "2" / "data" / "metadata"
    item.write_text(json.dumps({"position": 32, "seed": 0}))
    assert train.main([*base, "steps=4", "model.d_ff=96"]) == 2
    err = capsys.readouterr().err
    assert "does not fit this model's state" in err and "params.blocks.mlp.w_gate: (2, 64, 128) in the checkpoint, " \
                                                         "(2, 64, 96) in this model" in err
    assert train.main([*base, "steps=3"]) == 0  # the same model resumes


def test_damaged_checkpoint_names_the_step_and_the_way_out(tmp_path, capsys):
    base = [*TINY, f"run_dir={tmp_path}", "ckpt.every_steps=2", "ckpt.keep=5"]
    assert train.main([*base, "steps=6"]) == 0
    ck = tmp_path / "checkpoints"
    (ck / "6" / "data" / "metadata").unlink()
    (ck / "4" / "state" / "_METADATA").unlink()
    for f in (ck / "2" / "state" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated array data
    for step, what, hint in [("6", "the data item", "to resume from step 4"),
                             ("4", "the array metadata", "to resume from step 2"),
                             ("2", "the arrays", "no earlier checkpoint exists")]:
        assert train.main([*base, "steps=8"]) == 4, step
        err = capsys.readouterr().err
        assert f"cannot read {what} of the checkpoint at {ck / step}" in err and hint in err, err
        assert len(err) < 2000, err  # one message, not Orbax's traceback
        (ck / step).rename(tmp_path / f"damaged-{step}")
    # A step directory renamed to another number holds another step's state.
    assert train.main([*base, "steps=2"]) == 0
    (ck / "2").rename(ck / "3")
    assert train.main([*base, "steps=4"]) == 4
    assert "holds the state of step 2, not 3" in capsys.readouterr().err


def test_config_yaml_waits_for_the_first_step_and_a_fresh_start_drops_old_records(tmp_path, capsys, monkeypatch):
    """A resume whose first step fails to compile (here: a failing train step) leaves config.yaml as it was; a run
    stopped before its first checkpoint, started again, keeps one metrics record per step."""
    base = [*TINY, f"run_dir={tmp_path}", "ckpt.every_steps=2", "log.every_steps=1"]
    assert train.main([*base, "steps=2"]) == 0
    before = _snapshot(tmp_path)

    def failing(setup):
        def step(state, batch):
            raise ValueError("compile failed")
        return step

    with monkeypatch.context() as m:
        m.setattr(train, "make_train_step", failing)
        with pytest.raises(ValueError, match="compile failed"):
            train.main([*base, "steps=4", "optim.lr_peak=0.5"])
    assert _snapshot(tmp_path) == before
    fresh = tmp_path / "fresh"
    assert train.main([*TINY, f"run_dir={fresh}", "steps=2", "ckpt.every_steps=-1", "log.every_steps=1"]) == 0
    assert train.main([*TINY, f"run_dir={fresh}", "steps=3", "ckpt.every_steps=-1", "log.every_steps=1"]) == 0
    steps = [json.loads(line)["step"] for line in (fresh / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps


def test_unusable_run_dir_and_init_from_are_config_errors(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    for args, named in [([f"run_dir={tmp_path / 'file'}"], "'run_dir': "),
                        ([f"run_dir={tmp_path / 'run'}"], "'run_dir': "),
                        ([f"run_dir={tmp_path / 'new'}", f"init_from={tmp_path / 'missing'}"], "'init_from': "),
                        ([f"run_dir={tmp_path / 'new'}", f"init_from={tmp_path / 'weights'}"], "no config.json")]:
        assert train.main([*TINY, "steps=1", *args]) == 2, args
        err = capsys.readouterr().err
        assert named in err and "Traceback" not in err, err
        if "missing" in args[-1]:  # checked before the run directory is made
            assert "does not exist" in err and not (tmp_path / "new").exists()
    assert not (tmp_path / "new" / "config.yaml").exists()  # nothing recorded for a run that never started


def test_data_may_move_but_not_change(tmp_path, capsys):
    import shutil

    from mx_jax import data

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        (src / f"doc{i}.txt").write_bytes(bytes(rng.integers(32, 127, size=400, dtype=np.uint8)))
    data.convert([str(src)], str(tmp_path / "tok"), shard_tokens=5000)
    run = [*TINY, f"run_dir={tmp_path / 'run'}", "ckpt.every_steps=2", "data.source=bin"]
    assert train.main([*run, "steps=2", f"data.path={tmp_path / 'tok'}"]) == 0
    shutil.copytree(tmp_path / "tok", tmp_path / "moved")  # the same data on a new mount
    assert train.main([*run, "steps=3", f"data.path={tmp_path / 'moved'}"]) == 0
    assert f"data.path moved from {tmp_path / 'tok'} to {tmp_path / 'moved'}" in capsys.readouterr().out
    for i in range(40):  # the data changed (every document, whichever split its path hash puts it in)
        (src / f"doc{i}.txt").write_bytes(bytes(rng.integers(32, 127, size=800, dtype=np.uint8)))
    data.convert([str(src)], str(tmp_path / "other"), shard_tokens=5000)
    assert train.main([*run, "steps=4", f"data.path={tmp_path / 'other'}"]) == 2
    assert "config key 'data.path': the checkpoint at" in capsys.readouterr().err


def test_checkpointer_closed_before_any_save_has_removed_stale_temporary_steps(tmp_path):
    """Orbax removes a crashed save's temporary step directory in a thread it starts at open and awaits only in its
    next save; a run stopped before its first save (a config error at resume) exited with that thread running (a
    traceback at interpreter shutdown). Checkpointer.close waits for it: the stale directory is gone after close."""
    from mx_jax import checkpoint
    from mx_jax.config import CkptConfig

    stale = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1234"
    (stale / "state").mkdir(parents=True)
    (stale / "state" / "junk").write_bytes(b"x" * 1000)
    ckpt = checkpoint.Checkpointer(tmp_path, CkptConfig())
    ckpt.close()
    assert not stale.exists()
    assert ckpt.latest_step() is None
    # the thread's future was awaited (and dropped) by close, not left running (None too where Orbax has no such one)
    assert getattr(ckpt.manager, "_cleanup_tmp_directory_future", None) is None
