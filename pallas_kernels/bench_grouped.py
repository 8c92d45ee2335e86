"""Grouped-GEMM benchmark for MoE experts (issue 5 targets), run on one H100/H200.

    python -m pallas_kernels.bench grouped [--quick]          # through the bench driver (section "grouped")
    python -m pallas_kernels.bench_grouped [--quick]          # standalone, from the repo root
    python -m pallas_kernels.bench_grouped --cpu-smoke        # tiny shapes interpreted on CPU: checks the script
    python -m pallas_kernels.bench_grouped --problem deepseek # configs/deepseek_moe_16b.yaml's experts instead
    python -m pallas_kernels.bench_grouped --problem qwen3    # configs/qwen3_30b_a3b.yaml's: E=128, K=2048, N=768

Forward grouped GEMM y = x @ w[e(r)] at E=8, M=16384 token rows, K=D=4096, N=F=14336 (the up/gate projection of a
Mixtral-sized expert), balanced routing (2048 rows per expert) and skewed routing (one expert 40% of the rows, the
rest split evenly), in TFLOP/s of 2*M*K*N. `--problem deepseek`: E=64 fine-grained experts, K=2048, N=1408, M=24576
(4096 tokens, top-6), where the skewed routing leaves 63 groups of ~234 rows, none a multiple of the tile:
    xla bf16       jax.lax.ragged_dot_general (what MaxText uses)
    batched bf16   balanced routing only: the same GEMMs as one batched dot_general over (E, M/E, K) x (E, K, N),
                   cuBLAS's batched GEMM through XLA: the best path without custom kernels when every group has the
                   same size, and the ceiling a grouped kernel should reach there
    pallas bf16    our Mosaic-GPU kernel, best of a small tile sweep (config printed)
    xla fp8        lax.ragged_dot_general on the e4m3 operands + the scales as an XLA fusion
    pallas fp8     our kernel, rowwise W8A8: x e4m3 per row, w e4m3 per (expert, output channel), K-major
Then fwd+bwd of the expert FFN, SwiGLU through mx_jax.grouped_linear (gate/up (E, D, F), down (E, F, D), f32
master weights), in ms, for bf16 and fp8_rowwise; and fwd+bwd of the whole MoE layer (`mx_jax.moe.MoE` built from
configs/mixtral_8x7b.yaml or configs/deepseek_moe_16b.yaml: router, top-k, sort by expert, the three grouped GEMMs,
weighted combine, shared experts, aux loss) on M / top_k tokens, so its grouped GEMMs see the same M rows. The
layer's routing is what its freshly initialized router picks (near balanced; the max / mean load is printed). Its
"overhead" column is the layer's time minus the expert FFN's: routing, the row permutations and the combine.

Timing: compile once, 3 warm-up calls, then the median over `samples` of the mean of `batch` back-to-back calls
ended by block_until_ready; inputs are random normal (operands are far larger than L2, one input set suffices).
Correctness: relative Frobenius error against the f32 reference GEMM on 512 sampled rows (the same quantized
operands for fp8); the FFN compares Pallas against XLA's ragged dot with the same recipe.
Targets (issue 5): bf16 >= 780 / 650 TFLOP/s (balanced / skewed), fp8 >= 1150 / 900.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mx_jax import compat
from mx_jax.config import QuantConfig, load_config
from mx_jax.dispatch import expert_recipe
from mx_jax.grouped_linear import grouped_linear
from mx_jax.llama import compute_copies, plan_linears, with_compute
from mx_jax.moe import MoE
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.bench import rel_err, time_fn

F8 = jnp.float8_e4m3fn
TARGETS = {"bf16": (780, 650), "fp8": (1150, 900)}  # TFLOP/s, (balanced, skewed)


def _log(*args) -> None:
    print(*args, flush=True)


@dataclasses.dataclass(frozen=True)
class Problem:
    e: int
    m: int
    k: int
    n: int
    samples: int
    batch: int
    sampled_rows: int


FULL = Problem(e=8, m=16384, k=4096, n=14336, samples=10, batch=10, sampled_rows=512)
# configs/deepseek_moe_16b.yaml's routed experts (64, top-6, D=2048, d_expert=1408), 4096 tokens: M = 6 x 4096 rows.
DEEPSEEK = Problem(e=64, m=24576, k=2048, n=1408, samples=10, batch=20, sampled_rows=512)
# configs/qwen3_30b_a3b.yaml's experts (128, top-8, D=2048, d_expert=768), 4096 tokens: M = 8 x 4096 rows, 256 each.
QWEN3 = Problem(e=128, m=32768, k=2048, n=768, samples=10, batch=20, sampled_rows=512)
PROBLEMS = {"mixtral": FULL, "deepseek": DEEPSEEK, "qwen3": QWEN3}
_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
LAYER_CONFIGS = {"mixtral": "mixtral_8x7b.yaml", "deepseek": "deepseek_moe_16b.yaml",  # the MoE layer of each
                 "qwen3": "qwen3_30b_a3b.yaml"}
SMOKE = Problem(e=4, m=256, k=128, n=256, samples=1, batch=1, sampled_rows=64)


def routings(p: Problem) -> dict[str, jax.Array]:
    """Balanced: M/E rows each. Skewed: expert 0 holds 40% of the rows, the others split the rest evenly."""
    balanced = np.full(p.e, p.m // p.e)
    balanced[: p.m - balanced.sum()] += 1
    big = int(round(0.4 * p.m))
    rest = np.full(p.e - 1, (p.m - big) // (p.e - 1))
    rest[: p.m - big - rest.sum()] += 1
    skewed = np.concatenate([[big], rest])
    return {"balanced": jnp.asarray(balanced, jnp.int32), "skewed": jnp.asarray(skewed, jnp.int32)}


def sweep(dtype, quick: bool, smoke: bool, n: int) -> list[gm.TileConfig]:
    """A few points around the default that tile N; each prints its TFLOP/s, the best one is reported."""
    tk = 128 // jnp.dtype(dtype).itemsize
    if smoke:
        return [gm.TileConfig(tile_m=64, tile_n=64, tile_k=tk, stages=2)]
    wide = gm.TileConfig(tile_m=64, tile_n=256, tile_k=tk, wg_split="m")
    deep = dict(stages=4, epi_tile_n=64, delay_release=1)  # gmm's default: 4 stages, each released a step late
    configs = [
        gm.TileConfig(tile_k=tk, **deep),  # CTA 128x256 as two 128x128 warpgroup tiles side by side
        gm.TileConfig(tile_k=tk),  # the same with 3 stages, each awaited (the 4-stage tile's fallback)
        gm.TileConfig(tile_k=tk, cluster="n"),  # 2-CTA clusters multicast A: 1/6 less L2->SMEM traffic
        # CTA 128x256 as two 64x256 warpgroup tiles stacked: each k-step's wgmma reads (64 + 256) rows of SMEM per
        # 64x256 outputs instead of 2 x (64 + 128) per 128x128, 17% less SMEM read per FLOP (cuBLAS's bf16 shape).
        wide,
    ]
    if not quick:
        configs += [
            dataclasses.replace(wide, stages=4, epi_tile_n=64),
            dataclasses.replace(wide, cluster="n"),
            dataclasses.replace(wide, grid_minor="n", grid_tile_width=8),
            gm.TileConfig(tile_k=tk, stages=4, epi_tile_n=64),  # one more stage, half-width epilogue chunks
            gm.TileConfig(tile_k=tk, grid_minor="n", grid_tile_width=8),  # walk N-bands instead of M-bands
        ]
    tall = gm.TileConfig(tile_k=tk, wg_split="m")  # CTA 256x128: the dispatcher's pick where 256 does not divide N
    if quick:
        configs += [] if n % 256 == 0 else [dataclasses.replace(tall, **deep), tall]
    else:  # 256x128 and 128x128 CTA tiles: the ones that tile N = 1408 (DeepSeek's d_expert, 11 x 128)
        configs += [
            dataclasses.replace(tall, **deep),
            tall,
            dataclasses.replace(tall, stages=4, epi_tile_n=64),
            dataclasses.replace(tall, grid_minor="n", grid_tile_width=8),
            gm.TileConfig(tile_m=64, tile_k=tk, wg_split="m"),  # CTA 128x128: half the partial-tile waste
            gm.TileConfig(tile_m=64, tile_k=tk, wg_split="m", stages=4),
        ]
    return [c for c in configs if n % (c.cta_tile_n * c.cluster_size) == 0]


def _sampled_reference(p: Problem, sizes, x, w, **kw) -> tuple[jax.Array, jax.Array]:
    """(rows (S,), f32 reference of out[rows]): sorted sampled rows keep the grouping, so the reference GEMM runs on
    S rows with their group sizes."""
    rows = np.sort(np.random.default_rng(0).choice(p.m, p.sampled_rows, replace=False))
    gid = np.asarray(gm.row_groups(sizes, p.m))[rows]
    sizes_s = jnp.asarray(np.bincount(gid, minlength=p.e + 1)[: p.e], jnp.int32)
    lhs_scale = kw.pop("lhs_scale", None)
    if lhs_scale is not None:
        kw["lhs_scale"] = lhs_scale[rows]
    ref = jax.jit(functools.partial(gm.gmm_reference, out_dtype=jnp.float32, **kw))(x[rows], w, sizes_s)
    return jnp.asarray(rows), ref


@dataclasses.dataclass
class GemmResult:
    tflops: float
    err: float
    config: str


def bench_forward(p: Problem, quick: bool, smoke: bool, dtypes=("bf16", "fp8")) -> dict[tuple[str, str], GemmResult]:
    flops = 2.0 * p.m * p.k * p.n
    kx, kw, ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (p.m, p.k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (p.e, p.k, p.n), jnp.float32) / np.sqrt(p.k)).astype(jnp.bfloat16)
    # fp8 rowwise operands, quantized once outside the timed region (the GEMM alone, like torch._scaled_grouped_mm).
    amax_x = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1)
    xs = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax_x, 1e-12) / 448.0)))  # (M,) power-of-two dequant scales
    xq = (x.astype(jnp.float32) / xs[:, None]).astype(F8)
    w_t = jnp.swapaxes(w, 1, 2)  # (E, N, K) K-major
    amax_w = jnp.max(jnp.abs(w_t.astype(jnp.float32)), axis=2)
    ws = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax_w, 1e-12) / 448.0)))  # (E, N)
    wq_t = (w_t.astype(jnp.float32) / ws[:, :, None]).astype(F8)
    del w_t, amax_x, amax_w
    timing = dict(samples=p.samples, batch=p.batch)
    results: dict[tuple[str, str], GemmResult] = {}

    def run(label, routing, fn, args, ref, config=""):
        try:
            t = time_fn(fn, [args], **timing)
            ms, compile_s, out = t.ms, t.compile_s, t.out
        except Exception as e:  # a config that does not compile must not end the sweep
            _log(f"  {routing:9s} {label:12s} {config:40s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            return None
        rows, y_ref = ref
        err = rel_err(out[rows], y_ref)
        tflops = flops / (ms * 1e-3) / 1e12
        _log(f"  {routing:9s} {label:12s} {config:40s} {ms:8.3f} ms {tflops:7.0f} TFLOP/s  err {err:.1e}"
             f"  (compile {compile_s:.1f}s)")
        return GemmResult(tflops, err, config)

    for routing, sizes in routings(p).items():
        ref_bf16 = _sampled_reference(p, sizes, x, w)
        ref_fp8 = _sampled_reference(p, sizes, xq, wq_t, transpose_rhs=True, lhs_scale=xs, rhs_scale=ws)
        r = run("xla bf16", routing, functools.partial(gm.gmm, impl="xla"), (x, w, sizes), ref_bf16)
        if r:
            results[(routing, "xla bf16")] = r
        if routing == "balanced" and p.m % p.e == 0 and "bf16" in dtypes:
            def batched(x, w, sizes):  # every group holds M/E rows: one batched GEMM
                y = jnp.einsum("gmk,gkn->gmn", x.reshape(p.e, p.m // p.e, p.k), w)
                return y.reshape(p.m, p.n)

            r = run("batched bf16", routing, batched, (x, w, sizes), ref_bf16)
            if r:
                results[(routing, "batched bf16")] = r
        best = None
        for c in sweep(jnp.bfloat16, quick, smoke, p.n) if "bf16" in dtypes else ():
            r = run("pallas bf16", routing, functools.partial(gm.gmm, impl="pallas", config=c), (x, w, sizes),
                    ref_bf16, c.name())
            if r and (best is None or r.tflops > best.tflops):
                best = r
        if best:
            results[(routing, "pallas bf16")] = best
        fp8_args = (xq, wq_t, sizes, xs, ws)

        def fp8_gemm(impl, config, xq, wq_t, sizes, xs, ws):
            return gm.gmm(xq, wq_t, sizes, transpose_rhs=True, lhs_scale=xs, rhs_scale=ws, impl=impl, config=config)

        if "fp8" not in dtypes:
            continue
        if not quick:
            r = run("xla fp8", routing, functools.partial(fp8_gemm, "xla", None), fp8_args, ref_fp8)
            if r:
                results[(routing, "xla fp8")] = r
        best = None
        for c in sweep(F8, quick, smoke, p.n):
            r = run("pallas fp8", routing, functools.partial(fp8_gemm, "pallas", c), fp8_args, ref_fp8, c.name())
            if r and (best is None or r.tflops > best.tflops):
                best = r
        if best:
            results[(routing, "pallas fp8")] = best
    return results


def _ffn_loss(x, w_gate, w_up, w_down, sizes, cot, *, recipe, impl):
    gl = functools.partial(grouped_linear, recipe=recipe, impl=impl)
    h = jax.nn.silu(gl(x, w_gate, sizes)) * gl(x, w_up, sizes)  # (M, F)
    y = gl(h.astype(x.dtype), w_down, sizes)  # (M, D)
    return jnp.sum(y.astype(jnp.float32) * cot)


def bench_ffn(p: Problem, quick: bool, smoke: bool) -> dict[tuple[str, str], tuple[float, float]]:
    """fwd+bwd of the SwiGLU experts: {(recipe, impl): (ms, rel. err of the grads vs XLA with the same recipe)}."""
    d, f = p.k, p.n
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (p.m, d), jnp.float32).astype(jnp.bfloat16)
    # bf16 weights: the compute copies the train step feeds the experts (llama.compute_copies)
    w_gate = (jax.random.normal(keys[1], (p.e, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    w_up = (jax.random.normal(keys[2], (p.e, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[3], (p.e, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[4], (p.m, d), jnp.float32)
    sizes = routings(p)["balanced"]
    args = (x, w_gate, w_up, w_down, sizes, cot)
    timing = dict(samples=max(1, p.samples // 2), batch=max(1, p.batch // 2))
    results = {}
    for recipe in ("bf16", "fp8_rowwise"):
        grads = {}
        for impl in ("pallas", "xla"):
            if impl == "xla" and quick and not smoke:
                continue  # ~10x slower than the kernels; the full run times it once per recipe
            # value_and_grad: with grad alone XLA drops the down projection's forward GEMM (y only feeds the loss).
            fn = jax.value_and_grad(functools.partial(_ffn_loss, recipe=recipe, impl=impl), argnums=(0, 1, 2, 3))
            try:
                t = time_fn(fn, [args], **timing)
                ms, compile_s, out = t.ms, t.compile_s, t.out
            except Exception as e:
                _log(f"  ffn {recipe:12s} {impl:7s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            grads[impl] = out[1]
            results[(recipe, impl)] = (ms, float("nan"))
            _log(f"  ffn {recipe:12s} {impl:7s} fwd+bwd {ms:9.3f} ms  (compile {compile_s:.1f}s)")
        if "pallas" in grads and "xla" in grads:
            err = max(rel_err(a, b) for a, b in zip(grads["pallas"], grads["xla"]))
            results[(recipe, "pallas")] = (results[(recipe, "pallas")][0], err)
    return results


def moe_layer_step(problem: str, recipe: str, impl: str, smoke: bool = False, expert_min_rows: int | None = None):
    """fwd+bwd of one MoE layer of `problem`'s config: (fn, args, info).

    fn(params, x, cot) -> ((loss, load), (dparams, dx)) with loss = sum(y * cot) + aux_loss_coef * aux_loss; x (1, T,
    D) bf16 with T = M / top_k tokens; the GEMM weights come as the train step feeds them, the compute-dtype (bf16)
    copies of the f32 masters that AdamW writes (llama.compute_copies; the router stays f32). info: tokens, top_k,
    the recipe the routed experts run (bf16 with too few rows per expert for quant.expert_min_rows at their dims:
    `expert_min_rows`, None = the config's default), and the layer's GEMM FLOPs (routed and shared experts,
    forward + both backward GEMMs; the router's 2 T D E are left out)."""
    p = SMOKE if smoke else PROBLEMS[problem]
    over = [f"quant.recipe={recipe}"]
    if smoke:
        over += [f"model.d_model={p.k}", f"model.moe.d_expert={p.n}", f"model.moe.n_experts={p.e}",
                 "model.moe.top_k=2", "model.n_heads=4", "model.n_kv_heads=4"]
    cfg = load_config(os.path.join(_CONFIGS, LAYER_CONFIGS[problem]), over)
    m = cfg.model
    qcfg = QuantConfig(recipe=recipe)
    if expert_min_rows is not None:
        qcfg = dataclasses.replace(qcfg, expert_min_rows=expert_min_rows)
    plan = plan_linears(m, qcfg)
    shared = {n: plan.recipes[f"shared.{n}"] for n in ("w_gate", "w_up", "w_down")} if m.moe.n_shared else {}
    layer = MoE(m, plan.recipes["experts"], impl, shared, min_rows=plan.expert_min_rows, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    pure = nnx.to_pure_dict(params)
    nnx.replace_by_pure_dict(params, with_compute(pure, compute_copies(m, pure)))
    tokens = p.m // m.moe.top_k
    kx, kc = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (1, tokens, m.d_model), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, (1, tokens, m.d_model), jnp.float32)
    coef = m.moe.aux_loss_coef

    def loss(params, x, cot):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * cot) + coef * stats["aux_loss"], stats["load"]

    def fn(params, x, cot):
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, cot)

    f = m.moe.d_expert or m.d_ff
    flops = 18.0 * tokens * m.d_model * f * (m.moe.top_k + m.moe.n_shared)
    experts = expert_recipe(plan.recipes["experts"], tokens * m.moe.top_k, m.moe.n_experts, plan.expert_min_rows,
                            (m.d_model, f))
    info = {"tokens": tokens, "top_k": m.moe.top_k, "experts_recipe": experts, "flops": flops}
    return fn, (params, x, cot), info


def bench_layer(problem: str, quick: bool, smoke: bool) -> dict[tuple[str, str], tuple[float, float, float, str]]:
    """fwd+bwd of the whole MoE layer: {(label, impl): (ms, TFLOP/s, max rel. error of dx vs XLA, same recipe, the
    routed experts' recipe)}.

    impl "auto" is what the model runs (the grouped-GEMM kernels, our fp8 linears for the shared experts where they
    apply); "xla" runs jax.lax.ragged_dot and XLA's dots (bf16 always, fp8 in the full run). Where fp8_rowwise
    leaves the routed experts in bf16 (quant.expert_min_rows), "fp8_forced" is the same layer with them in fp8."""
    p = SMOKE if smoke else PROBLEMS[problem]
    timing = dict(samples=max(1, p.samples // 2), batch=max(1, p.batch // 2))
    results = {}
    variants = [("bf16", "bf16", None), ("fp8_rowwise", "fp8_rowwise", None)]
    while variants:
        label, recipe, min_rows = variants.pop(0)
        dx = {}
        for impl in ("auto", "xla"):
            if impl == "xla" and quick and recipe != "bf16" and not smoke:
                continue
            fn, args, info = moe_layer_step(problem, recipe, "pallas" if smoke and impl == "auto" else impl, smoke,
                                            min_rows)
            if label == "fp8_rowwise" and impl == "auto" and info["experts_recipe"] == "bf16":
                variants.append(("fp8_forced", recipe, 0))
            try:
                t = time_fn(fn, [args], **timing)
            except Exception as e:  # noqa: BLE001
                _log(f"  layer {recipe:12s} {impl:7s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            (_, load), (_, dx[impl]) = t.out
            load = np.asarray(load)
            tflops = info["flops"] / (t.ms * 1e-3) / 1e12
            results[(label, impl)] = (t.ms, tflops, float("nan"), info["experts_recipe"])
            _log(f"  layer {label:12s} {impl:7s} fwd+bwd {t.ms:9.3f} ms {tflops:6.0f} TFLOP/s  {info['tokens']} tokens"
                 f" top-{info['top_k']}, experts {info['experts_recipe']}, max/mean load {load.max() / load.mean():.2f}"
                 f"  (compile {t.compile_s:.1f}s)")
            del args, t
        if "auto" in dx and "xla" in dx:
            ms, tflops, _, experts = results[(label, "auto")]
            results[(label, "auto")] = (ms, tflops, rel_err(dx["auto"], dx["xla"]), experts)
    return results


def bench_grouped(
    quick: bool, cpu_smoke: bool = False, dtypes=("bf16", "fp8"), ffn: bool = True, problem: str = "mixtral",
    forward: bool = True,
) -> dict:
    """Run the forward sweep, the expert FFN and the whole MoE layer, print a compact table last; returns the
    numbers. ffn=False skips both fwd+bwd timings, forward=False the forward GEMM sweep."""
    p = SMOKE if cpu_smoke else PROBLEMS[problem]
    # The targets are Mixtral's; other problems print "-" there.
    targets = {d: [f"{t:6d}" for t in ts] if p is FULL else ["     -"] * 2 for d, ts in TARGETS.items()}
    t_start = time.perf_counter()
    _log(f"grouped GEMM: E={p.e} M={p.m} K={p.k} N={p.n}  ({jax.devices()[0].device_kind}, jax {jax.__version__})")
    fwd = bench_forward(p, quick, cpu_smoke, dtypes) if forward else {}
    lay = bench_layer(problem, quick, cpu_smoke) if ffn else {}
    ffn = bench_ffn(p, quick, cpu_smoke) if ffn else {}

    _log("\n" + "=" * 118)
    if fwd:
        _log(f"grouped GEMM forward, E={p.e} M={p.m} K={p.k} N={p.n}, {jax.devices()[0].device_kind},"
             f" jax {jax.__version__} -- TFLOP/s (err: rel. Frobenius vs f32 reference;"
             f" section {time.perf_counter() - t_start:.0f}s)")
        cols = ("xla bf16", "batched bf16", "pallas bf16", "xla fp8", "pallas fp8")
        _log(f"{'routing':9s} | {'xla bf16':>8s} {'batched':>8s} {'pal bf16':>8s} {'target':>6s} | {'xla fp8':>8s}"
             f" {'pal fp8':>8s} {'target':>6s} | {'err bf16':>8s} {'err fp8':>8s} | best bf16 config / best fp8 config")
        for i, routing in enumerate(("balanced", "skewed")):
            v = [fwd[(routing, c)].tflops if (routing, c) in fwd else float("nan") for c in cols]
            e = [fwd[(routing, c)].err if (routing, c) in fwd else float("nan") for c in ("pallas bf16", "pallas fp8")]
            cfg = [fwd[(routing, c)].config if (routing, c) in fwd else "-" for c in ("pallas bf16", "pallas fp8")]
            _log(f"{routing:9s} | {v[0]:8.0f} {v[1]:8.0f} {v[2]:8.0f} {targets['bf16'][i]} | {v[3]:8.0f} {v[4]:8.0f}"
                 f" {targets['fp8'][i]} | {e[0]:8.1e} {e[1]:8.1e} | {cfg[0]} / {cfg[1]}")
    if ffn:
        _log(f"expert FFN fwd+bwd (SwiGLU via grouped_linear, balanced, D={p.k} F={p.n}), ms "
             "(err: max rel. error of the 4 grads, Pallas vs XLA, same recipe)")
    for (recipe, impl), (ms, err) in ffn.items():
        _log(f"  {recipe:12s} {impl:7s} {ms:9.3f} ms" + (f"   err {err:.1e}" if err == err else ""))
    if lay:
        _log(f"whole MoE layer fwd+bwd ({LAYER_CONFIGS[problem]}, {p.m} expert rows), ms and GEMM TFLOP/s; overhead ="
             " layer - expert FFN (err: rel. error of dx, ours vs XLA, same recipe)")
    for (label, impl), (ms, tflops, err, experts) in lay.items():
        key = (experts, "pallas" if impl == "auto" else impl)
        extra = f"   overhead {ms - ffn[key][0]:7.3f} ms" if key in ffn else ""
        _log(f"  {label:12s} {impl:7s} {ms:9.3f} ms {tflops:6.0f} TFLOP/s  experts {experts:11s}{extra}"
             + (f"   err {err:.1e}" if err == err else ""))
    return {"forward": {f"{r}/{c}": dataclasses.asdict(v) for (r, c), v in fwd.items()},
            "ffn_ms": {f"{r}/{i}": v[0] for (r, i), v in ffn.items()},
            "layer_ms": {f"{r}/{i}": v[0] for (r, i), v in lay.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="four tile configs per dtype (the default first), no XLA fp8 / XLA FFN")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas kernels interpreted on CPU")
    ap.add_argument("--dtypes", default="bf16,fp8", help="comma-separated subset of bf16,fp8 to sweep")
    ap.add_argument("--no-ffn", action="store_true", help="skip the expert FFN and MoE layer fwd+bwd timings")
    ap.add_argument("--layer-only", action="store_true",
                    help="only the fwd+bwd timings: the whole MoE layer and the expert FFN (no forward GEMM sweep)")
    ap.add_argument("--problem", choices=sorted(PROBLEMS), default="mixtral",
                    help="mixtral: the issue's E=8 D=4096 F=14336 (default); deepseek: E=64 D=2048 F=1408, M=24576; "
                         "qwen3: E=128 D=2048 F=768, M=32768")
    args = ap.parse_args(argv)
    ctx = contextlib.nullcontext()
    if args.cpu_smoke:
        from pallas_kernels import interpret_compat

        interpret_compat.install()
        ctx = compat.force_gpu_interpret_mode(compat.InterpretGPUParams())
    _log(f"command: python -m pallas_kernels.bench_grouped {' '.join(sys.argv[1:] if argv is None else argv)}")
    with ctx:
        bench_grouped(args.quick, cpu_smoke=args.cpu_smoke, dtypes=tuple(args.dtypes.split(",")),
                      ffn=not args.no_ffn, problem=args.problem, forward=not args.layer_only)


if __name__ == "__main__":
    main()
