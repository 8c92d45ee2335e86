"""Synthetic fine-tuning data for checking the loss-masked path, and an exact-answer check of a model tuned on it.

    python benchmarks/sft_check.py data OUT          # OUT/arith.jsonl (200,000 chats), OUT/code.jsonl (~1 KB replies)
    python -m mx_jax.data convert OUT/arith.jsonl --out ARITH --chat-template chatml
    python -m mx_jax.train --config configs/llama3_140m.yaml data.source=bin data.path=ARITH \\
        model.attention_mask=documents steps=600 ckpt.every_steps=0 run_dir=RUN
    python benchmarks/sft_check.py accuracy RUN 40   # greedy replies to fresh sums: how many are exact

arith.jsonl: "What is a + b?" -> "a+b" for a, b < 1000 (a reply of 1-4 digits: about a fifth of the bytes are
targets). code.jsonl: "Show FILE from character N." -> a piece of a standard-library module (200 bytes plus an
exponential length of mean 1,000), for throughput with long replies.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys
import sysconfig


def write_data(out: pathlib.Path, n_arith: int = 200_000) -> None:
    out.mkdir(parents=True, exist_ok=True)
    r = random.Random(0)
    with open(out / "arith.jsonl", "w") as f:
        for _ in range(n_arith):
            a, b = r.randrange(1000), r.randrange(1000)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"{a + b}"}]}) + "\n")
    n = 0
    with open(out / "code.jsonl", "w") as f:
        for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            src, pos = p.read_text(errors="replace"), 0
            while pos < len(src):
                k = int(r.expovariate(1 / 1000)) + 200
                f.write(json.dumps({"messages": [{"role": "user", "content": f"Show {p.name} from character {pos}."},
                                                 {"role": "assistant", "content": src[pos:pos + k]}]}) + "\n")
                pos += k
                n += 1
    print(f"{out / 'arith.jsonl'}: {n_arith} chats; {out / 'code.jsonl'}: {n} chats")


def accuracy(run: pathlib.Path, n: int) -> None:
    import jax

    from mx_jax import data, sample, sharding, train

    cfg = sample.load_config(str(run / "config.yaml"), ["quant.recipe=bf16", "mesh.data=1", "mesh.fsdp=1",
                                                        "mesh.expert=1", "mesh.context=1"])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    right = 0
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        params, buffers = sample.load_model_state(cfg, setup, run, None)
        template = data.ChatTemplate("chatml", "byte", "sft_check")
        decoder = sample.Decoder(setup, params, buffers, temperature=0)
        r = random.Random(123)
        for i in range(n):
            a, b = r.randrange(1000), r.randrange(1000)
            ids = list(template.render([{"role": "user", "content": f"What is {a} + {b}?"}], True, "").encode())
            out = decoder.run([ids], 12, stop_id=0)
            reply = bytes(int(t) for t in out[0]).split(b"<")[0].decode(errors="replace")
            right += reply.strip() == str(a + b)
            if i < 4:
                print(f"What is {a} + {b}? -> {reply!r}")
    print(f"exact answers: {right}/{n}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("data", "accuracy"):
        sys.exit(__doc__)
    if sys.argv[1] == "data":
        write_data(pathlib.Path(sys.argv[2]))
    else:
        accuracy(pathlib.Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 100)
