"""Batched decoding with a static KV cache: what `generate_corpus` samples the teacher with.

Every step feeds one token per sequence at one shared position, so all shapes stay fixed. On CUDA each
transformer block is compiled with inductor (regional compilation: the blocks share one graph, so the compile
costs one block's, not the whole step's: a shard's first batch came after 20 s instead of about 76 on the GPU, session
61; see COMPILE_OPTIONS for its determinism), and the whole step (the
blocks, the LM head and the draw) is captured as a CUDA graph per cache bucket and replayed, so a step costs one
launch instead of ~30 layers × a dozen kernels, which is what bounds small-model decoding. Two more things keep
the step short:
  * attention reads the cache only up to the next multiple of `KV_BUCKET` past the position (one CUDA graph
    per bucket, all of them over one compile of the block: the length is a dynamic size), not the whole `max_len`:
    at 1024 tokens that halves the cache traffic on average;
  * the draw is Gumbel-max inside the graph (argmax of logits/T + Gumbel noise samples the softmax
    exactly), so no [batch, vocab] tensor leaves the graph; top-k / top-p restrict it in the graph too
    (`sample`: top-k draws among the k largest logits only).
On the CPU the same code runs eager, in float32. Draws use the global RNG: seed it with `torch.manual_seed`
(a CUDA graph's draws advance it as eager ones do, and a capture's warm-up run draws on a forked state, so one seed
gives one corpus, from a fresh Decoder or a used one)."""

from __future__ import annotations

import torch
import torch._inductor.config
import torch.nn.functional as F

from nvg.model import autocast

KV_BUCKET = 256

# "deterministic" (inductor of torch >= 2.10) skips the on-device benchmarking whose winner can change a reduction's
# order: a cold compile cache, or another machine, would otherwise round the logits differently, a near-tie would draw
# another token, and everything after it in that sequence would differ. With it the same seed writes the same corpus
# (four H200 sessions had written four corpora from one seed). No "triton.cudagraphs": the Decoder captures the whole
# step itself.
COMPILE_OPTIONS = {"deterministic": True} if hasattr(torch._inductor.config, "deterministic") else {}


def gumbel_argmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A draw from softmax(logits / temperature) for every row ([b, vocab] → [b]); argmax at temperature 0."""
    if temperature <= 0:
        return logits.argmax(-1)
    u = torch.rand_like(logits, dtype=torch.float32).clamp_(min=1e-20)
    return (logits.float() / temperature - torch.log(-torch.log(u))).argmax(-1)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Next ids [b] from logits [b, vocab]: a draw from softmax(logits / temperature) restricted to the
    top_k ids (0 = all) and to the smallest set whose probability reaches top_p (1.0 = all). Every shape is
    fixed, so the draw compiles into the decoder's graph; with top_k, Gumbel-max runs over the k largest
    logits only ([b, k], already sorted for top_p), not over the vocabulary."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits, ids = logits.float() / temperature, None
    if 0 < top_k < logits.shape[-1]:
        logits, ids = logits.topk(top_k, dim=-1)
    if top_p < 1.0:
        if ids is None:
            logits, ids = logits.sort(dim=-1, descending=True)
        p = logits.softmax(-1)
        logits = logits.masked_fill(p.cumsum(-1) - p >= top_p, float("-inf"))  # kept until the mass before reaches top_p
    choice = gumbel_argmax(logits, 1.0)
    return choice if ids is None else ids.gather(-1, choice[:, None])[:, 0]


class Decoder:
    """Decodes `batch` sequences of up to `max_len` tokens together with `model` (dense or BLR)."""

    def __init__(self, model, batch: int, max_len: int, device: torch.device, precision: str,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, backend: str | None = None):
        """`backend` compiles the blocks with torch.compile (default: inductor on CUDA, none on the CPU; the tests
        pass a recording backend to see the graphs dynamo traces on the CPU)."""
        # On the CPU a step feeds one token per sequence, so bf16 autocast would cast every weight each step for
        # a few rows of work: the default job's 64 × 256 tokens took 111.8 s so, against 88.8 s in float32.
        self.model, self.device = model, device
        self.precision = precision if device.type == "cuda" else "fp32"
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.batch, self.max_len = batch, max_len
        # the cache holds K/V in the compute dtype
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}
        model.setup_cache(batch, max_len, half.get(self.precision, torch.float32))
        # The step's inputs live in these: a CUDA graph replays on fixed addresses, so each step writes into them.
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.greedy = torch.zeros((), dtype=torch.bool, device=device)
        # The blocks read the cache up to the length of the slice of this they are given: a tensor's size, marked
        # dynamic, so their compile is symbolic in it from the first bucket on (an int is compiled as a constant
        # first, then once more as a symbol), and one compile serves every bucket.
        self.kv_positions = torch.arange(max_len, device=device)
        backend = backend or ("inductor" if device.type == "cuda" else None)
        if backend:
            # A new Decoder is traced anew (new cache and weights), from a clean compile state.
            torch.compiler.reset()
            options = COMPILE_OPTIONS if backend == "inductor" else None
            for layer in model.model.layers:
                layer.compile(fullgraph=True, backend=backend, options=options)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # cache length → its step, captured
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def _step(self, kv_window: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.precision):
            h = self.model.decode(self.ids[:, None], self.pos, kv_window)[:, -1]
            logits = F.linear(h, self.model.logits_head())
        return self._draw(logits)

    def _draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next ids [b] from the logits [b, vocab]: argmax where `greedy`, else `sample`'s draw, in float32.
        Eager inside the captured step: about eight float32 passes over [batch, vocabulary] (100 MB each at 512
        sequences) a step. bench/decode_compile.py's CompiledDrawDecoder compiles it as a second region, to be
        measured on the GPU before it is the stage's."""
        logits = logits.float()
        return torch.where(self.greedy, logits.argmax(-1), sample(logits, self.temperature, self.top_k, self.top_p))

    def _captured(self, kv_window: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step at this cache length as a CUDA graph and its output buffer: run once on a side stream first
        (the blocks compile at the first length; cuBLAS and Triton set up), then captured. That run writes this
        position's keys and values as the replay will; its draw is made on a forked RNG state, so the replays draw
        as they would without it: a Decoder used twice from one seed draws the same tokens whether or not it had
        captured this length already (session 63: the second use drew other tokens from the first sampled position
        on). The graphs share one memory pool: they replay one at a time, each after the one before."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.random.fork_rng(devices=[self.device]):
            self._step(kv_window)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(kv_window)
        return graph, out

    @torch.no_grad()
    def next_ids(self, ids: torch.Tensor, pos: int, greedy: bool) -> torch.Tensor:
        """The ids [b] that follow `ids` [b] fed at position `pos`: argmax when `greedy`, else drawn.
        A fresh tensor (a CUDA graph's output buffer is reused by its next replay)."""
        self.ids.copy_(ids)
        self.pos.fill_(pos)
        self.greedy.fill_(greedy)
        kv_len = min(self.max_len, (pos // KV_BUCKET + 1) * KV_BUCKET)
        if self.pool is None:
            return self._step(self._kv_window(kv_len))
        if kv_len not in self.graphs:  # a replay needs no window: the captured step holds it
            self.graphs[kv_len] = self._captured(self._kv_window(kv_len))
        graph, out = self.graphs[kv_len]
        graph.replay()
        return out.clone()

    def _kv_window(self, kv_len: int) -> torch.Tensor:
        """The cache positions the blocks read, `kv_len` of them, as a tensor whose size the compile keeps symbolic."""
        kv_window = self.kv_positions[:kv_len]
        torch._dynamo.mark_dynamic(kv_window, 0)
        return kv_window
