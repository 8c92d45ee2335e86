"""mx_jax.sample: text from a checkpoint, decoded with a KV cache (llama.Llama.decode) over left-padded prompts."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import sample, sharding, train
# NO_EVAL: the runs here are sampled from, never evaluated
from tests.helpers import MLA, NO_EVAL, need_devices, tiny_config

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
    the cached keys and values give the full forward's logits."""
    trained = train.train(tiny_config(tmp_path, "steps=4", "mesh.data=1", "mesh.fsdp=1", NO_EVAL, *(MOE if moe else []),
                                      *(["mesh.expert=1"] if moe else [])), devices=jax.devices()[:1])
    mesh, setup, params, buffers = _setup_and_state(tmp_path)
    if moe:  # the router biases the run learned come back (they change the expert choice)
        np.testing.assert_array_equal(np.asarray(jax.tree.leaves(buffers)[0]),
                                      np.asarray(jax.tree.leaves(trained.state["buffers"])[0]))
    prompt = list(b"def f(x):\n    return")
    with jax.set_mesh(mesh):
        out = sample.generate(setup, params, buffers, prompt, 20, num=2, temperature=0)
        logits, _ = nnx.merge(setup.graphdef, params, buffers)(jnp.asarray(out), logits_dtype=jnp.float32)
    assert out.shape == (2, len(prompt) + 20) and (out[:, :len(prompt)] == prompt).all()
    np.testing.assert_array_equal(out[:, len(prompt):], np.argmax(np.asarray(logits), -1)[:, len(prompt) - 1:-1])


@pytest.mark.parametrize("layers", [[], ["model.n_layers=5", "model.moe.n_dense_first=1", "model.moe.every_n_layers=2",
                                          *MOE], ["model.qk_norm=true", "model.attention_bias=true"],
                                    ["model.rope_scaling.kind=yarn", "model.rope_scaling.factor=4",
                                     "model.rope_scaling.original_max_len=16"],
                                    [*MLA, "model.rope_scaling.kind=yarn", "model.rope_scaling.factor=4",
                                     "model.rope_scaling.original_max_len=16", "model.rope_scaling.mscale_all_dim=1",
                                     "model.rope_scaling.attention_factor=1.3"]],
                         ids=["dense", "moe_groups", "qwen_attention", "yarn", "mla_yarn"])
def test_decode_of_left_padded_rows_gives_the_forward_logits(layers):
    """Llama.decode over a KV cache: a prefill of two rows padded on the left to a common length, then one token at a
    time, gives each row the logits of a full forward over that row alone (float32); a MoE model with a dense first
    layer and groups of a dense and a MoE layer has a cache of each of its stacks."""
    from mx_jax import llama
    from tests.helpers import TINY

    cfg = sample.load_config(None, [*TINY, *layers]).model
    model = llama.Llama(cfg, rngs=nnx.Rngs(0))
    rows = [np.asarray(jax.random.randint(jax.random.key(i), (n,), 1, 256)) for i, n in enumerate((20, 13))]
    width, prefill = 24, 16  # the rows start at positions 4 and 11; the prefill holds 12 and 5 of their tokens
    tokens = np.zeros((2, width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, width - len(r):] = r
    first = jnp.asarray([width - len(r) for r in rows], jnp.int32)
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        want = [np.asarray(model(jnp.asarray(r[None]))[0][0]) for r in rows]  # (T, V) each, alone
        step = jax.jit(lambda m, t, c, i: m.decode(t, c, i, first))
        logits, cache = step(model, jnp.asarray(tokens[:, :prefill]), llama.init_cache(cfg, 2, 32, jnp.float32), 0)
        got = [logits]
        for i in range(prefill, width):
            logits, cache = step(model, jnp.asarray(tokens[:, i:i + 1]), cache, i)
            got.append(logits)
    got = np.stack(got, axis=1)  # (2, width - prefill + 1, V): after positions prefill - 1 .. width - 1
    for i, r in enumerate(rows):
        at = np.arange(prefill - 1, width) - (width - len(r))  # the same positions, counted in the row alone
        np.testing.assert_allclose(got[i], want[i][at], atol=2e-5, rtol=1e-5)


def test_a_batch_of_prompts_decodes_each_as_alone(two_steps):
    """Prompts of different lengths in one batch (left-padded), and one filling a batch twice, draw what each draws
    alone; a batch stops once each row has drawn the stop token, every row's tokens up to it unchanged."""
    mesh, setup, params, buffers = _setup_and_state(two_steps)
    prompts = [list(b"import numpy as np\n"), list(b"x"), list(b"def main():\n    ")]
    with jax.set_mesh(mesh):
        decoder = sample.Decoder(setup, params, buffers, temperature=0)
        alone = [decoder.run([p], 24)[0] for p in prompts]
        together = decoder.run(prompts + prompts[:1], 24)
        stop = int(alone[1][3])
        cut = decoder.run(prompts, 24, stop_id=stop)
    ends = [list(a).index(stop) + 1 if stop in a else 24 for a in alone]
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(together[i], alone[i])
        np.testing.assert_array_equal(cut[i, :ends[i]], alone[i][:ends[i]])
    np.testing.assert_array_equal(together[3], alone[0])
    assert cut.shape[1] == max(ends)  # cut after the last row's stop token (24: a row never drew it)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run of the tiny model trained two steps on one device, shared by the tests that only sample from it."""
    run_dir = tmp_path_factory.mktemp("two_steps")
    train.train(tiny_config(run_dir, "steps=2", "mesh.data=1", "mesh.fsdp=1", NO_EVAL), devices=jax.devices()[:1])
    return run_dir


def test_checkpoint_is_read_with_the_gemm_weights_in_the_compute_dtype(tmp_path, monkeypatch):
    """load_model_state has Orbax cast the float32 masters of the GEMM weights and the embedding to bfloat16 as it
    reads them (what it asks Orbax for), so no device holds the masters: the same values as the train step's compute
    copies (and the embedding's rows as its lookup casts them), bit for bit, with the norms left float32."""
    import orbax.checkpoint as ocp

    from mx_jax.llama import with_compute

    trained = train.train(tiny_config(tmp_path, "steps=2", "mesh.data=1", "mesh.fsdp=1", NO_EVAL,
                                      "model.compute_dtype=bfloat16"), devices=jax.devices()[:1])
    asked, restore = [], ocp.PyTreeCheckpointer.restore

    def recorded(self, path, args=None, **kw):
        asked.append(args.item)
        return restore(self, path, args=args, **kw)

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", recorded)
    _, _, params, _ = _setup_and_state(tmp_path)
    assert asked[0]["params"]["blocks"]["mlp"]["w_up"].dtype == jnp.bfloat16
    want = with_compute(trained.state["params"], trained.state["compute"])
    want["embed"] = want["embed"].astype(jnp.bfloat16)
    assert params["blocks"]["attn"]["wq"].dtype == jnp.bfloat16 and params["head"].dtype == jnp.bfloat16
    assert params["embed"].dtype == jnp.bfloat16 and params["final_norm"]["scale"].dtype == jnp.float32
    flat, flat_want = jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in flat] == [p for p, _ in flat_want]
    for (path, got), (_, ref) in zip(flat, flat_want):
        assert got.dtype == ref.dtype, path
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32), err_msg=str(path))


def test_sampling_draws_only_from_the_top_k_and_the_tokenizer_vocab(two_steps):
    mesh, setup, params, buffers = _setup_and_state(two_steps)
    prompt = list(b"import ")
    with jax.set_mesh(mesh):
        greedy = sample.generate(setup, params, buffers, prompt, 12, temperature=0)
        top1 = sample.generate(setup, params, buffers, prompt, 12, temperature=1.0, top_k=1, seed=3)
        hot = sample.generate(setup, params, buffers, prompt, 40, num=4, temperature=5.0, seed=1, vocab_limit=100,
                              top_k=1000)  # a k past the vocabulary keeps every token
        again = sample.generate(setup, params, buffers, prompt, 40, num=4, temperature=5.0, seed=1, vocab_limit=100)
        top5 = sample.generate(setup, params, buffers, prompt, 40, num=4, temperature=5.0, seed=2, top_k=5)
        logits, _ = nnx.merge(setup.graphdef, params, buffers)(jnp.asarray(top5), logits_dtype=jnp.float32)
    np.testing.assert_array_equal(greedy, top1)
    assert hot[:, len(prompt):].max() < 100  # ids beyond the tokenizer's vocabulary are never drawn
    assert len({tuple(r) for r in hot}) == 4  # the batch's rows are drawn independently
    np.testing.assert_array_equal(hot, again)  # a seed fixes the draw
    # each token drawn with top_k=5 is among the 5 largest logits of a teacher-forced forward at its position,
    # and at temperature 5 the draws are not all the largest one
    drawn = top5[:, len(prompt):]
    ranks = (np.asarray(logits)[:, len(prompt) - 1:-1] > np.take_along_axis(
        np.asarray(logits)[:, len(prompt) - 1:-1], drawn[..., None], -1)).sum(-1)
    assert ranks.max() <= 4 and (ranks > 0).mean() > 0.3, ranks


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
    assert "2 x 8 tokens, byte tokenizer, quant.recipe=bf16: prompt of 4 tokens and first two draws" in out.err
    assert "draws/s" in out.err
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
    prompts = tmp_path.parent / "prompts.jsonl"
    prompts.write_text('{"prompt": "x = "}\n')
    missing = tmp_path.parent / "nodir" / "answers.jsonl"
    assert sample.main([str(tmp_path), "--prompts", str(prompts), "--out", str(missing)]) == 2
    assert f"--out: the directory {missing.parent} does not exist" in capsys.readouterr().err  # before any decoding
    assert sample.main([str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path.parent)]) == 2
    assert f"--out: {tmp_path.parent} is a directory" in capsys.readouterr().err
    text = tmp_path.parent / "prompt.txt"
    text.write_text("def main():\n")
    assert sample.main([str(tmp_path), "--prompts", str(text)]) == 2
    assert "prompt.txt is not a file of records" in capsys.readouterr().err
    # a damaged step: exit 4, one message naming the step and what was unreadable, not Orbax's reports
    for f in (tmp_path / "checkpoints" / "2" / "state" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(f.read_bytes()[:10])
    assert sample.main([str(tmp_path), "--tokens", "4"]) == 4
    err = capsys.readouterr().err
    assert f"cannot read the parameters of the checkpoint at {tmp_path / 'checkpoints' / '2'}" in err, err
    assert "OUT_OF_RANGE" in err and "the run has no other step" in err and len(err) < 1000, err
    # its arrays gone (a half-copied step): Orbax's tree metadata fails to open them, with the same exit code, and
    # `hf export` exits 4 too, writing nothing
    state = tmp_path / "checkpoints" / "2" / "state"
    for sub in ("ocdbt.process_0", "d"):
        shutil.rmtree(state / sub, ignore_errors=True)
    assert sample.main([str(tmp_path), "--tokens", "4"]) == 4
    err = capsys.readouterr().err
    assert "cannot read the parameters of the checkpoint" in err and len(err) < 1000, err
    from mx_jax import hf

    assert hf.main(["export", str(tmp_path), str(tmp_path.parent / "hf_out")]) == 4
    err = capsys.readouterr().err
    assert "cannot read the parameters of the checkpoint" in err and "Traceback" not in err, err
    assert not (tmp_path.parent / "hf_out").exists()


def test_prompts_are_answered_in_file_order_and_exact_answers_counted(two_steps, capsys):
    """answer_prompts batches the prompts longest first and fills the last batch; its records come back in the
    file's order with each sample's text, and a reference counts as exact only when the sample drew it and then the
    end-of-text token."""
    mesh, setup, params, buffers = _setup_and_state(two_steps)
    tok = sample.Tokenizer("byte")
    texts = ["import ", "def f(x):\n    return x", "y", "class A:\n"]
    with jax.set_mesh(mesh):
        decoder = sample.Decoder(setup, params, buffers, temperature=0)
        alone = [decoder.run([tok.encode(t)], 8)[0] for t in texts]
        stop = int(alone[0][4])  # "import " ends after 5 tokens with it as the end of text
        first = [tok.decode([int(t) for t in a[:list(a).index(stop)]]) if stop in a else None for a in alone]
        prompts = [sample.Prompt(i, [t], ref) for i, (t, ref) in
                   enumerate(zip(texts, [first[0], "no such text", None, first[3] or "z"]))]
        recs = sample.answer_prompts(decoder, tok, prompts, 8, num=2, batch=3, seed=0, stop_id=stop, vocab_size=256,
                                     progress=False)
    assert [(r["index"], r["sample"]) for r in recs] == [(i, j) for i in range(4) for j in range(2)]
    for r in recs:
        a = [int(t) for t in alone[r["index"]]]
        end = a.index(stop) if stop in a else None
        assert r["prompt"] == texts[r["index"]] and r["output"] == tok.decode(a[:end])
        assert r["ended"] == (end is not None)
    assert [r.get("exact") for r in recs[::2]] == [True, False, None, first[3] is not None]
    sample._write_answers(recs, str(two_steps / "answers.jsonl"), 1.0)
    assert f"exact answers {2 + 2 * (first[3] is not None)}/6" in capsys.readouterr().err
    assert [json.loads(line) for line in (two_steps / "answers.jsonl").read_text().splitlines()] == recs
    assert not (two_steps / "answers.jsonl.partial").exists()


@pytest.mark.parametrize("n", [2, 4])
def test_several_devices_split_the_weights_and_draw_what_one_does(two_steps, n):
    """--devices n: each weight split along its heads, hidden or vocabulary dimension, the embedding whole (n = 4
    splits the tiny model's 2 key/value heads inside them: its cache stays whole), the same greedy tokens as one
    device."""
    need_devices(n)
    mesh, setup, params, buffers = _setup_and_state(two_steps)
    prompts = [list(b"import os\n"), list(b"def")]
    with jax.set_mesh(mesh):
        want = sample.Decoder(setup, params, buffers, temperature=0).run(prompts, 16)
    split = sample.tensor_parallel(setup, jax.devices()[:n])
    params, buffers = sample.load_model_state(setup.cfg, setup, two_steps, None, split[:2])
    wq = params["blocks"]["attn"]["wq"]
    assert tuple(wq.sharding.spec) == (None, None, "tensor") and len(wq.addressable_shards) == n
    assert wq.addressable_shards[0].data.shape == (wq.shape[0], wq.shape[1], wq.shape[2] // n)
    assert tuple(params["head"].sharding.spec) == (None, "tensor")
    assert tuple(params["embed"].sharding.spec) == ()  # whole: its one-row lookups move nothing
    decoder = sample.Decoder(setup, params, buffers, temperature=0, cache_sharding=split.cache)
    np.testing.assert_array_equal(decoder.run(prompts, 16), want)
    cache = decoder._cache(2, 128)
    assert cache["blocks"].k.sharding.spec[-2] == ("tensor" if n == 2 else None)


def test_several_devices_split_a_latent_attention_model(tmp_path):
    """--devices 2 on a model with model.mla (a query latent, values wider than the query heads): the latent
    attention's head-wise matrices split along their heads' outputs, its latent projections and its cache of
    latents whole; the same greedy tokens as one device."""
    need_devices(2)
    train.train(tiny_config(tmp_path, "steps=2", "mesh.data=1", "mesh.fsdp=1", NO_EVAL, *MLA), devices=jax.devices()[:1])
    mesh, setup, params, buffers = _setup_and_state(tmp_path)
    prompts = [list(b"import os\n"), list(b"def")]
    with jax.set_mesh(mesh):
        want = sample.Decoder(setup, params, buffers, temperature=0).run(prompts, 12)
    split = sample.tensor_parallel(setup, jax.devices()[:2])
    params, buffers = sample.load_model_state(setup.cfg, setup, tmp_path, None, split[:2])
    attn = params["blocks"]["attn"]
    assert tuple(attn["wkv_b"].sharding.spec) == (None, None, "tensor")
    assert tuple(attn["wq_b"].sharding.spec) == (None, None, "tensor")
    assert tuple(attn["wkv_a"].sharding.spec) in ((), (None, None, None))  # the latent stays whole
    decoder = sample.Decoder(setup, params, buffers, temperature=0, cache_sharding=split.cache)
    np.testing.assert_array_equal(decoder.run(prompts, 12), want)
    cache = decoder._cache(2, 64)["blocks"]  # the latents (16) and the rotated key (8), whole on each device
    assert (cache.c.shape[-2:], cache.k_rope.shape[-2:]) == ((1, 16), (1, 8))
    assert cache.c.sharding.spec[-2] is None


@pytest.fixture(scope="module")
def moe_two_steps(tmp_path_factory):
    """A run of the tiny model with routed and shared experts, trained two steps on one device."""
    run_dir = tmp_path_factory.mktemp("moe_two_steps")
    train.train(tiny_config(run_dir, "steps=2", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", NO_EVAL, *MOE,
                            "model.moe.n_shared=1"), devices=jax.devices()[:1])
    return run_dir


def test_several_devices_split_a_moe_models_experts(moe_two_steps, capsys):
    """--devices 2 on a MoE model: the routed experts split along their hidden width (moe.hidden_split), every
    device routing every token; the same greedy tokens as one device. A width the devices do not divide is refused
    by name."""
    need_devices(3)
    mesh, setup, params, buffers = _setup_and_state(moe_two_steps)
    prompts = [list(b"import os\n"), list(b"def")]
    with jax.set_mesh(mesh):
        want = sample.Decoder(setup, params, buffers, temperature=0).run(prompts, 16)
    split = sample.tensor_parallel(setup, jax.devices()[:2])
    params, buffers = sample.load_model_state(setup.cfg, setup, moe_two_steps, None, (split.params, split.buffers))
    w_gate, w_down = params["blocks"]["moe"]["w_gate"], params["blocks"]["moe"]["w_down"]
    assert tuple(w_gate.sharding.spec) == (None, None, None, "tensor") and w_down.sharding.spec[2] == "tensor"
    assert w_down.addressable_shards[0].data.shape == (*w_down.shape[:2], w_down.shape[2] // 2, w_down.shape[3])
    with sample.moe.hidden_split(split.mesh):
        got = sample.Decoder(setup, params, buffers, temperature=0, cache_sharding=split.cache).run(prompts, 16)
    np.testing.assert_array_equal(got, want)
    args = [str(moe_two_steps), "--tokens", "8", "--prompt", "x = ", "--temperature", "0"]
    outs = []
    for extra in ([], ["--devices", "2"]):
        assert sample.main([*args, *extra]) == 0
        got = capsys.readouterr()
        outs.append(got.out.split("----- sample")[1])
        assert ("split over 2 devices" in got.err) == bool(extra)
    assert outs[0] == outs[1]
    assert sample.main([*args, "--devices", "3"]) == 2
    assert "3 devices do not divide the experts' hidden width 128" in capsys.readouterr().err


def test_cli_out_of_device_memory_names_the_allocation_and_what_splits_it(two_steps, capsys, monkeypatch):
    """Out of device memory while sampling: exit code 5, XLA's allocation quoted, and --devices named; any other
    runtime error is raised as it was."""
    errors = []

    def run_fails(*args, **kwargs):
        raise errors[-1]

    monkeypatch.setattr(sample.Decoder, "run", run_fails)
    args = [str(two_steps), "--tokens", "8", "--prompt", "x = "]
    errors.append(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 93.40GiB "
                                             "with allocator GPU_0_bfc on device 0."))
    assert sample.main(args) == 5
    err = capsys.readouterr().err
    assert "out of device memory allocating 93.40GiB" in err and "--devices N splits the model over N" in err
    errors.append(jax.errors.JaxRuntimeError("INTERNAL: an unrelated failure"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="unrelated"):
        sample.main(args)


def test_cli_several_devices(two_steps, capsys):
    need_devices(2)
    assert sample.main([str(two_steps), "--devices", "2", "--tokens", "8", "--prompt", "x = ", "--temperature",
                        "0"]) == 0
    two = capsys.readouterr().out
    assert sample.main([str(two_steps), "--tokens", "8", "--prompt", "x = ", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split("----- sample")[1] == two.split("----- sample")[1]
    assert sample.main([str(two_steps), "--devices", "99"]) == 2
    assert f"--devices: 99, but this process has {jax.local_device_count()}" in capsys.readouterr().err
