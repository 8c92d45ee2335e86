"""The `--dry-run` shape estimate (mx_jax/memory_estimate.py) against the per-GPU peaks measured on H200s.

    python benchmarks/estimate_check.py            # CPU is enough: the estimate traces shapes only (~15 s)

Each row is a run recorded in benchmarks/RESULTS.md (the session is named) with the peak it measured
(`memory_stats()["peak_bytes_in_use"]`, GiB) or, where marked XLA, the per-device total of the step compiled for the
GPUs (`python -m mx_jax.train --dry-run` on a machine holding the mesh's GPUs, GB). Rerun it after changing the
estimate; the table prints the estimate, its transient part and the error against the measurement.

The measured expert-parallel runs all used model.moe.exchange=auto, one process holding the GPUs: "land" at
expert=2 and 4, which is also what the estimate assumes there (memory_estimate._gpu_config).
"""

from __future__ import annotations

from mx_jax import memory_estimate
from mx_jax.config import load_config

GIB = 1.073741824  # GB per GiB
EMB = "data.source=embedded ckpt.every_steps=-1"
FP8 = "quant.recipe=fp8_rowwise"
B4K = f"{EMB} data.seq_len=4096 data.batch_size=8 {FP8}"  # two 4,096-token sequences per GPU on 4 GPUs
EP4 = "mesh.fsdp=1 mesh.expert=4"
F4 = "mesh.fsdp=4 mesh.expert=1"
SAVE = "model.moe.ep_save_gate_up=true"
E2 = f"{EMB} data.seq_len=4096 data.batch_size=4 {FP8} mesh.fsdp=1 mesh.expert=2"  # two sequences per GPU on 2
EP2 = f"{E2} model.moe.ep_buffer_factor=1.5"  # so that the compact buffer runs at P = 2
B8 = f"{EMB} data.seq_len=8192"
DOCS = "model.attention_mask=documents model.eos_id=0"  # measured on byte-token shards of ~1 KB documents

# (what, config, overrides, measured, unit, session)
RUNS = [
    ("8B 32 layers, 1 GPU, remat=full, bf16 moments", "llama3_8b",
     f"{B8} data.batch_size=1 mesh.fsdp=1 model.remat=full {FP8} optim.moment_dtype=bfloat16", 92.9, "GiB", 29),
    ("8B 32 layers, 1 GPU, remat=full", "llama3_8b", f"{B8} data.batch_size=1 mesh.fsdp=1 model.remat=full {FP8}",
     122.8, "GiB", 29),
    ("8B 32 layers, fsdp=4", "llama3_8b", f"{B8} data.batch_size=4 mesh.fsdp=4 {FP8}", 60.45, "GiB", 38),
    ("8B 32 layers, fsdp=4, bf16", "llama3_8b", f"{B8} data.batch_size=4 mesh.fsdp=4 quant.recipe=bf16", 56.86,
     "GiB", 38),
    ("8B 32 layers, data=2 x fsdp=2", "llama3_8b", f"{B8} data.batch_size=4 mesh.data=2 mesh.fsdp=2 {FP8}", 88.37,
     "GiB", 38),
    ("8B 8 layers, 1 GPU", "llama3_8b", f"{B8} data.batch_size=1 mesh.fsdp=1 model.n_layers=8 {FP8}", 46.8, "GiB", 60),
    ("8B 8 layers, 1 GPU, documents, M=24", "llama3_8b", f"{B8} data.batch_size=1 mesh.fsdp=1 model.n_layers=8 {FP8} "
     f"{DOCS} model.max_documents=24", 52.8, "GiB", 61),
    ("8B 8 layers, 1 GPU, documents, M=32", "llama3_8b", f"{B8} data.batch_size=1 mesh.fsdp=1 model.n_layers=8 {FP8} "
     f"{DOCS} model.max_documents=32", 54.9, "GiB", 61),
    ("Mixtral 2 layers, fsdp=4", "mixtral_8x7b", f"model.n_layers=2 {B4K} {F4}", 18.3, "GiB", 58),
    ("Mixtral 2 layers, expert=4", "mixtral_8x7b", f"model.n_layers=2 {B4K} {EP4}", 25.6, "GiB", 59),
    ("Mixtral 2 layers, expert=4, saved gate/up", "mixtral_8x7b", f"model.n_layers=2 {B4K} {EP4} {SAVE}", 31.2, "GiB",
     59),
    ("Mixtral 2 layers, expert=2, f=1.5 (XLA)", "mixtral_8x7b", f"model.n_layers=2 {EP2}", 35.64, "GB", 60),
    ("Mixtral 2 layers, expert=2, f=1.5, saved (XLA)", "mixtral_8x7b", f"model.n_layers=2 {EP2} {SAVE}", 39.91, "GB",
     60),
    ("DeepSeekMoE 4 layers, expert=2, f=1.5 (XLA)", "deepseek_moe_16b", f"model.n_layers=4 {EP2}", 25.08, "GB", 60),
    ("DeepSeekMoE 4 layers, expert=2", "deepseek_moe_16b", f"model.n_layers=4 {E2}", 21.2, "GiB", 60),
    ("DeepSeekMoE 4 layers, fsdp=4", "deepseek_moe_16b", f"model.n_layers=4 {B4K} {F4}", 14.6, "GiB", 58),
    ("DeepSeekMoE 4 layers, expert=4", "deepseek_moe_16b", f"model.n_layers=4 {B4K} {EP4}", 18.0, "GiB", 59),
    ("DeepSeekMoE 4 layers, expert=4, saved gate/up", "deepseek_moe_16b", f"model.n_layers=4 {B4K} {EP4} {SAVE}", 20.1,
     "GiB", 59),
    ("DeepSeekMoE 16B 28 layers, fsdp=4", "deepseek_moe_16b", f"{B4K} {F4}", 86.0, "GiB", 58),
    ("DeepSeekMoE 16B 28 layers, expert=4", "deepseek_moe_16b", f"{B4K} {EP4}", 84.2, "GiB", 58),
    ("DeepSeekMoE 16B 28 layers, expert=4, saved", "deepseek_moe_16b", f"{B4K} {EP4} {SAVE}", 98.8, "GiB", 59),
]


def main() -> None:
    print("| run | session | estimate GB (transient) | measured GB | estimate / measured |")
    print("|---|---|---|---|---|")
    for what, config, overrides, measured, unit, session in RUNS:
        report = memory_estimate.estimate(load_config(f"configs/{config}.yaml", overrides.split()))
        gb = measured * (GIB if unit == "GiB" else 1.0)
        print(f"| {what} | {session} | {report['total_gb']:.1f} ({report['transient_gb']:.2f}) | {gb:.1f} | "
              f"{report['total_gb'] / gb - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
