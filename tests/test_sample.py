"""mx_jax.sample: text from a checkpoint, decoded without a KV cache over a right-padded window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import sample, sharding, train
from tests.helpers import NO_EVAL, tiny_config  # NO_EVAL: the runs here are sampled from, never evaluated

MOE = ["model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.score=sigmoid", "model.moe.bias_update_rate=0.01"]


def _setup_and_state(run_dir):
    cfg = sample.load_config(str(run_dir / "config.yaml"), ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=1",
                                                            "mesh.context=1"])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    setup = train.build(cfg, mesh)
    return mesh, setup, *sample.load_model_state(cfg, setup, run_dir, None)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_tokens_are_the_full_sequence_argmax(tmp_path, moe):
    """Each greedy token is the argmax of one teacher-forced forward over the final sequence at the previous position:
    the padding after the current position never reaches its logits. Two window sizes give the same text."""
    trained = train.train(tiny_config(tmp_path, "steps=4", "mesh.data=1", "mesh.fsdp=1", NO_EVAL, *(MOE if moe else []),
                                      *(["mesh.expert=1"] if moe else [])), devices=jax.devices()[:1])
    mesh, setup, params, buffers = _setup_and_state(tmp_path)
    if moe:  # the router biases the run learned come back (they change the expert choice)
        np.testing.assert_array_equal(np.asarray(jax.tree.leaves(buffers)[0]),
                                      np.asarray(jax.tree.leaves(trained.state["buffers"])[0]))
    prompt = list(b"def f(x):\n    return")
    with jax.set_mesh(mesh):
        out = sample.generate(setup, params, buffers, prompt, 20, num=2, temperature=0)
        wide = sample.generate(setup, params, buffers, prompt, 20, num=2, temperature=0, window=256)
        logits, _ = nnx.merge(setup.graphdef, params, buffers)(jnp.asarray(out), logits_dtype=jnp.float32)
    assert out.shape == (2, len(prompt) + 20) and (out[:, :len(prompt)] == prompt).all()
    np.testing.assert_array_equal(out, wide)
    np.testing.assert_array_equal(out[:, len(prompt):], np.argmax(np.asarray(logits), -1)[:, len(prompt) - 1:-1])


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run of the tiny model trained two steps on one device, shared by the tests that only sample from it."""
    run_dir = tmp_path_factory.mktemp("two_steps")
    train.train(tiny_config(run_dir, "steps=2", "mesh.data=1", "mesh.fsdp=1", NO_EVAL), devices=jax.devices()[:1])
    return run_dir


def test_sampling_draws_only_from_the_top_k_and_the_tokenizer_vocab(two_steps):
    mesh, setup, params, buffers = _setup_and_state(two_steps)
    prompt = list(b"import ")
    with jax.set_mesh(mesh):
        greedy = sample.generate(setup, params, buffers, prompt, 12, temperature=0)
        top1 = sample.generate(setup, params, buffers, prompt, 12, temperature=1.0, top_k=1, seed=3)
        hot = sample.generate(setup, params, buffers, prompt, 40, num=4, temperature=5.0, seed=1, vocab_limit=100,
                              top_k=1000)  # a k past the vocabulary keeps every token
        again = sample.generate(setup, params, buffers, prompt, 40, num=4, temperature=5.0, seed=1, vocab_limit=100)
    np.testing.assert_array_equal(greedy, top1)
    assert hot[:, len(prompt):].max() < 100  # ids beyond the tokenizer's vocabulary are never drawn
    assert len({tuple(r) for r in hot}) == 4  # the batch's rows are drawn independently
    np.testing.assert_array_equal(hot, again)  # a seed fixes the draw


def test_drawing_stops_once_every_sample_has_ended(two_steps):
    mesh, setup, params, buffers = _setup_and_state(two_steps)
    prompt = list(b"import ")
    with jax.set_mesh(mesh):
        full = sample.generate(setup, params, buffers, prompt, 16, temperature=0)
        stop = int(full[0, len(prompt) + 5])  # the sixth greedy token as the end-of-text token
        first = len(prompt) + list(full[0, len(prompt):]).index(stop)
        cut = sample.generate(setup, params, buffers, prompt, 16, temperature=0, stop_id=stop)
    np.testing.assert_array_equal(cut, full[:, :first + 1])
    assert sample.eos_of_run(setup.cfg) == 0  # the embedded corpus ends each file with NUL


def test_cli_prints_samples_and_names_bad_flags(tmp_path, capsys):
    tmp_path = tmp_path / "checkpoints" / "run"  # a run stored under a folder that happens to be named so
    train.train(tiny_config(tmp_path, "steps=2", "mesh.data=1", "mesh.fsdp=1", NO_EVAL), devices=jax.devices()[:1])
    assert sample.main([str(tmp_path / "checkpoints" / "2"), "--tokens", "8", "--prompt", "x = ", "--num", "2",
                        "--temperature", "0", "model.attention=xla"]) == 0  # overrides after the options
    out = capsys.readouterr()
    assert out.out.count("----- sample") == 2 and out.out.count("x = ") == 2
    assert "2 x 8 tokens, byte tokenizer, quant.recipe=bf16: first draw" in out.err
    assert "draws/s over a 128-position window" in out.err
    for flags, message in ((["--tokens", "0"], "--tokens: must be >= 1"),
                           (["model.d_model=48"], "does not fit this model"),
                           (["--temperature", "-1"], "--temperature: must be >= 0"),
                           (["--prompt", ""], "--prompt: an empty prompt"),
                           (["--step", "7"], "no checkpoint for step 7"),
                           (["--tokenizer", str(tmp_path / "nope.json")], "neither 'byte' nor an existing")):
        assert sample.main([str(tmp_path), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert sample.main([str(tmp_path / "elsewhere")]) == 2
    assert "elsewhere does not exist" in capsys.readouterr().err
    outside = tmp_path.parents[1] / "notes"  # in no run directory
    outside.mkdir()
    assert sample.main([str(outside)]) == 2
    assert "notes/config.yaml does not exist" in capsys.readouterr().err
