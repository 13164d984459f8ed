"""Host time of per-layer compiled blocks with one block signature against ten (docs/quality.md, session 46): does
dynamo's one cache for `Block.forward`, holding every signature's graphs, slow each block call? On the CPU, with
backend eager (the guards are dynamo's whatever the backend), on a 30-layer toy whose compute is small beside the
host's work; `bench/gpu_bench.py --graph-per-signature` gives each signature a cache of its own.

    python bench/guard_cost.py
"""

import importlib.util
import time
from pathlib import Path

import torch

from nvg.model import GRAPHS_PER_SIGNATURE, ModelConfig

spec = importlib.util.spec_from_file_location("gpu_bench", Path(__file__).with_name("gpu_bench.py"))
gpu_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_bench)

LAYERS, HIDDEN = 30, 64
CFG = ModelConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_layers=LAYERS, num_heads=4,
                  num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                  tie_word_embeddings=True)
SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (32, HIDDEN), "self_attn.v_proj": (32, HIDDEN),
          "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (2 * HIDDEN, HIDDEN), "mlp.up_proj": (2 * HIDDEN, HIDDEN),
          "mlp.down_proj": (HIDDEN, 2 * HIDDEN)}


def dense_weights() -> dict:
    torch.manual_seed(0)
    dense = {"model.norm.weight": torch.ones(HIDDEN), "model.embed_tokens.weight": torch.randn(256, HIDDEN) * 0.02}
    for i in range(LAYERS):
        dense.update({f"model.layers.{i}.{role}.weight": torch.randn(*shape) for role, shape in SHAPES.items()})
        dense.update({f"model.layers.{i}.{norm}.weight": torch.ones(HIDDEN)
                      for norm in ("input_layernorm", "post_attention_layernorm")})
    return dense


def plan(dense: dict, signatures: int) -> dict:
    """Layer i's linears: P = 2 at rank 8 when i ≡ 0 (mod signatures), else P = 1 at rank 8·(1 + i mod signatures)."""
    def paths_rank(layer: int):
        k = layer % signatures
        return (2, 8) if k == 0 else (1, 8 * (1 + k))
    return {n: paths_rank(int(n.split(".")[2])) for n in dense if n.endswith("_proj.weight")}


def ms_a_pass(dense: dict, signatures: int, per_signature: bool, grad: bool, passes: int = 30) -> float:
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 8 + GRAPHS_PER_SIGNATURE * signatures
    model = gpu_bench.blr_student(CFG, dense, 1.0, plan(dense, signatures))
    if per_signature:
        gpu_bench.graph_per_signature(model)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    x = torch.randint(0, 256, (1, 8))

    def one_pass():
        if grad:
            model(x).float().sum().backward()
        else:
            with torch.no_grad():
                model(x)
    with torch.no_grad():
        model(x)  # a no-grad graph per signature beside the training one, as evaluation leaves them
    for _ in range(3):
        one_pass()
    t = time.perf_counter()
    for _ in range(passes):
        one_pass()
    return (time.perf_counter() - t) / passes * 1e3


if __name__ == "__main__":
    torch.set_num_threads(1)
    dense = dense_weights()
    for grad in (False, True):
        for signatures, per_signature in ((1, False), (10, False), (10, True)):
            print(f"{'forward + backward' if grad else 'no-grad forward'}, {signatures} signature(s)"
                  f"{', a cache each' if per_signature else ''}: {ms_a_pass(dense, signatures, per_signature, grad):.2f} ms a pass",
                  flush=True)
