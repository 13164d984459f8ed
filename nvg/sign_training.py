"""Sign training (`train.signs.enabled`): the ±1 entries of S_U and S_V become trainable through
straight-through latents, the seed's `--train-signs`.

Every sign gets a real latent z with the sign of its bit, so every sign keeps its bit at the start.
`init` sets its magnitude: `uniform` puts every latent at τ, so the first bits to cross are the ones
with the noisiest gradients; `margin` (needs the teacher's weights and input Grams) gives each sign the
encoder's own judgement of it, its one-flip margin (`gram_margin`): how much E = tr((W − Ŵ) H (W − Ŵ)ᵀ)
would grow if that sign alone flipped. Scaled so that the matrix's median margin sits at τ and floored
at 2·hyst: a sign the encoder was nearly indifferent to starts close to the band and flips first, one it
needed stays far from it. The forward pass uses the bits. The backward pass takes ∂L/∂s straight
through, with surrogate slope k = 2/τ, as ∂L/∂z.
Sign matrices of one shape in `BUCKET_LAYERS` consecutive layers form a bucket: their latents are one
stacked tensor, and so are their bits (each matrix a view of them). As soon as the last gradient of a
bucket is ready (post-accumulate-grad hooks), the bucket's latents are updated in one step and its
gradients freed: so the sign gradients alive at once are those of buckets still waiting, never a buffer
for the whole model (at most BUCKET_LAYERS / layers of them plus one layer's). One update per matrix, 420 a step on SmolLM2, made the step host-bound: on the
H200 two profiled steps spent 2.5 s on the host, 1.9 s of it in the hooks, for 0.42 s of GPU time
(docs/benchmarks.md). A bit flips only when its latent crosses the hysteresis band: z > hyst gives +1,
z < −hyst gives −1, and in between the bit stays. Latents are clamped to ±clamp.

Optimizers (bytes of state per sign, besides the bit itself):
  adam      latent f32, first and second moment f32                        12 B
  factored  latent f32, first moment bf16, second moment factored into row
            and column means (Adafactor); the default                       6 B
  plain     latent f32; the step is the gradient over its matrix's RMS      4 B
plus 1 B per sign for the student's original bits (the distinct-flip count). Adam normalises every
sign on its own, so every latent moves by about η per step, noise included; on the toy problem in
tests/test_sign_training.py it flips many correct bits, where factored and plain solve it.

The normalised step of `adam` and `factored` is clipped as Adafactor's is (`update_clip`): each matrix's
step is scaled down to an RMS of at most `update_clip`. A second moment that lags a sudden rise of the
gradients would otherwise multiply the latents' moves by up to √(1/(1 − b2)), and flips raise the gradients:
on the H200 (session 22, η 0.04, 2550 steps) the flips per step went from 30k to 440k in 16 steps, the loss
from 0.8 to 4.4, and the held-out KL took 900 steps to come back to what it had been.
With `grad_clip` > 0 (off by default until the device has measured it; the GPU recipe's overlays set 2), each
matrix's gradient is scaled down, before the moments take it, to an RMS of at most `grad_clip` × its running
RMS (the second moment's, as it stood before this step), as AdaGC clips each tensor's norm against its own
history. The sign gradients are not clipped with the scales' (their updates run inside the backward
pass, before the step's norm is known), and one outlier batch otherwise enters the first moment whole: a
gradient k times the usual puts k/10 of it into the moment, which keeps it, decaying by b1 a step, for the
next twenty or so: every latent travels up to about k·η in the outlier's direction (5.5–5.9 η at k = 10 on
the toy of tests/test_sign_training.py; 1.3–1.4 η clipped at 2), against a band 2·hyst wide (0.2, five η at
the GPU recipe's 0.04). On the H200 (session 23) the flips a step rose by a level at each of three
batches whose scale gradient's norm was 3–7 × its neighbours' (steps 91, 103, 110: 31.5k → 40.7k, 57.4k →
64.1k, 82.0k → 112.7k) and kept rising from each, into the avalanche.

Step size: η = η0 · guard multiplier · spike multiplier · the metric's schedule shape, and 0 during the
first `warm` sign steps, while the moments settle. η0 auto = min(0.15·τ/√steps, 4e-3·τ). Guards halve the
guard multiplier (the seed's; it never recovers):
  * when the per-step flip rate exceeds `max_step_flip` three steps running;
  * when the distinct flipped fraction exceeds `max_total_flip` (checked at each evaluation);
  * when the held-out KL exceeds 1.05 × best twice running.
The spike guard (`spike_ratio`) halves the spike multiplier in the very step whose flips exceed
`spike_ratio` × their running mean as it stood `SPIKE_BASELINE` quiet steps earlier (an exponential mean over
the steps since the schedule's peak and `SPIKE_BASELINE` steps after the warm ones, spikes left out) and 5e-4
of all signs; after every `SPIKE_BASELINE` steps without a spike it doubles back, up to 1. An avalanche of
flips feeds itself within a few steps: faster than three steps running or an evaluation. The mean it is
compared with lags, because an avalanche that grows 15–30 % a step drags a current mean up behind it: on the
H200 (session 23) the flips rose from 57k to 367k a step in 18 steps and never exceeded 2.4 × the current
mean, but 3 × the mean of ten steps before in the avalanche's third step.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from nvg import fused_sign_step
from nvg.artifacts import check_grams, read_grams
from nvg.cmf import CmfFile
from nvg.errors import NvgError
from nvg.layout import BODY_ROLES, ROLE_INPUT, parse_body_linear
from nvg.settings import check

BYTES_PER_SIGN = {"adam": 12, "factored": 6, "plain": 4}
ROLES = tuple(BODY_ROLES)
BUCKET_LAYERS = 6  # consecutive layers whose same-shaped sign matrices are updated as one
SPIKE_BASELINE = 10  # steps after the warm ones before the mean starts, the lag of the mean a step's flips are
# compared with, and quiet steps before η doubles back
SPIKE_FLOOR = 5e-4  # a step flipping fewer of all signs is no spike, whatever its ratio (session 22: 3–4e-4 a step
# at the peak of a healthy run, 1.5e-3 in the avalanche's first step)
SPIKE_DECAY = 0.9  # of the running mean of flips a step


@dataclass
class SignSettings:
    """Config block `train.signs` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "train.signs"
    enabled: bool
    optimizer: str
    init: str
    tau: float
    eta: float | None
    warm: int
    b1: float
    b2: float
    eps: float
    clamp: float
    hyst: float
    max_step_flip: float
    max_total_flip: float
    update_clip: float
    grad_clip: float
    spike_ratio: float

    def __post_init__(self):
        check(self.clamp >= self.tau, self.SECTION, "clamp", f"must be >= tau {self.tau}, got {self.clamp}")
        check(self.hyst < self.tau, self.SECTION, "hyst", f"must be in [0, tau {self.tau}), got {self.hyst}")

    @property
    def margin(self) -> bool:
        """Whether the latents start from the encoder's margins (the teacher's weights and Grams needed)."""
        return self.enabled and self.init == "margin"

    def check_grams_given(self, grams) -> None:
        """A stage's `--grams` is given exactly when these settings read it."""
        if self.margin != (grams is not None):
            problem = "init: margin needs --grams" if self.margin else "--grams is read only by enabled signs with init: margin"
            raise NvgError(f"config {self.SECTION}: {problem}")

    def peak_eta(self, total_steps: int) -> float:
        if self.eta is not None:
            return self.eta
        return min(0.15 * self.tau / math.sqrt(max(1, total_steps)), 4e-3 * self.tau)


@torch.no_grad()
def gram_margin(m, w: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How much the encoder's objective E = tr(D H Dᵀ), D = W − Ŵ, grows when one sign of `m`'s S_U or S_V
    flips and everything else stays: with A = diag(h) S_U diag(ℓ) and B = S_V diag(g) of each path,
        ΔS_U[o, k] = 4 s h_o ℓ_k (D H Bᵀ)_ok + 4 h_o² ℓ_k² (B H Bᵀ)_kk
        ΔS_V[k, j] = 4 s g_j (Aᵀ D H)_kj + 4 g_j² ‖a_k‖² H_jj
    (s the sign's value). Negative where the flip alone would lower E. One D H and two products per path,
    in float64; `w` [d_out, d_in] is the teacher's weight, `H` [d_in, d_in] its input Gram."""
    h, ell, g, su, sv = (t.detach().double() for t in (m.h, m.ell, m.g, m.su, m.sv))
    H = H.to(h.device, torch.float64)
    DH = (w.detach().to(h.device, torch.float64) - torch.einsum("po,por,pr,pri,pi->oi", h, su, ell, sv, g)) @ H
    mu, mv = torch.empty_like(su), torch.empty_like(sv)
    for p in range(len(h)):
        a = h[p][:, None] * su[p] * ell[p]
        b = sv[p] * g[p]
        mu[p] = 4 * su[p] * h[p][:, None] * ell[p] * (DH @ b.T) + 4 * (h[p] ** 2)[:, None] * ell[p] ** 2 * ((b @ H) * b).sum(1)
        mv[p] = 4 * sv[p] * g[p] * (a.T @ DH) + 4 * g[p] ** 2 * (a * a).sum(0)[:, None] * H.diagonal()
    return mu.float(), mv.float()


def margin_magnitudes(margin: torch.Tensor, s: SignSettings) -> torch.Tensor:
    """|z| from one matrix's margins: the median positive margin at τ, floored at 2·hyst (a sign whose
    flip would lower E starts there too, keeping its bit until the gradient says otherwise), clamped."""
    pos = margin.clamp_min(0)
    unit = pos[pos > 0].median() if bool((pos > 0).any()) else torch.ones((), device=margin.device)
    return (pos / unit * s.tau).clamp(2 * s.hyst, s.clamp)


def latent_step(optimizer: str, g, p, st: dict, scalars, b1: float, b2: float, eps: float, hyst: float,
                clamp: float, update_clip: float, grad_clip: float) -> torch.Tensor:
    """One bucket's sign step, in place: `g`, `p` and the optimizer state `st` hold n matrices stacked on
    dim 0. The state takes the straight-through gradient `g` (each matrix's RMS clipped to `grad_clip` × its
    running RMS where it is > 0), the latents move by η times the normalised step (each matrix's RMS clipped
    to `update_clip` where it is > 0), the bits `p` follow the latents across the hysteresis band.
    `scalars` = (η, 2/τ/gscale, 1 − b1ᵗ, 1 − b2ᵗ, 1 − b2ᵗ⁻¹). A matrix with a non-finite gradient is left as
    it is, the others move.
    Returns (flips, saturated, clamped, non-finite, matrices whose gradient was clipped) as int64 [5], and the
    largest of the matrices' step RMS before the update clip (0-dim float32; 1 for `plain`): whether that clip
    binds, and how the step grows before flips do.

    No test branches on the host: a host sync per bucket would stall the backward pass. (Compiled with
    inductor on the H200 it made the step no faster: docs/benchmarks.md.) On CUDA the factored optimizer's
    step is `nvg.fused_sign_step`'s five Triton launches, the same arithmetic; this is its reference."""
    if optimizer == "factored" and g.is_cuda and fused_sign_step.triton is not None:
        return fused_sign_step.factored_step(g, p, st, scalars, b1, b2, eps, hyst, clamp, update_clip, grad_clip)
    eta, slope, bc1, bc2, bc2_before = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4]
    bad = ~torch.isfinite(g)
    finite = ~bad.flatten(1).any(1)  # per matrix
    w = finite.to(g.dtype).view(-1, *[1] * (g.dim() - 1))  # 1 for a matrix that moves, 0 for one left as it is
    w_rows = w.squeeze(-1)  # for the factored row and column moments, one dimension fewer
    g = torch.where(w > 0, g, 0.0) * slope  # straight through, surrogate slope 2/τ
    dims = tuple(range(1, g.dim()))
    clipped = torch.zeros((), dtype=torch.int64, device=g.device)
    # The factored moments need g² only through its row and column means: computed once, before the clip (whose
    # mean square it also gives), and the clip's scale² applied to those rank-sized means. What the clip still costs
    # at weight size is the clipped copy of g the first moment takes (13 % of the sign step: docs/benchmarks.md).
    g2 = g * g if optimizer == "factored" else None
    scale2 = None  # per matrix: the clip's scale, squared, [n, 1]
    if grad_clip > 0 and optimizer != "plain":  # plain divides by this step's own RMS: a gradient's size is lost anyway
        # each matrix's mean square so far (0 before its first step: nothing to compare with, no clip)
        seen = (st["v"] if optimizer == "adam" else st["v_row"]).flatten(1).mean(1) / bc2_before.clamp_min(1e-30)
        ms = (g2 if g2 is not None else g.pow(2)).mean(dims)
        scale = torch.where(seen > 0, (grad_clip**2 * seen / ms.clamp_min(1e-30)).sqrt().clamp_max(1.0), 1.0)
        clipped = (scale < 1).sum()
        g = g * scale.view(-1, *[1] * (g.dim() - 1))
        scale2 = scale.pow(2).view(-1, *[1] * (g.dim() - 2))
    if optimizer == "adam":
        st["m"].lerp_(g, (1 - b1) * w)
        st["v"].mul_(1 - (1 - b2) * w).addcmul_(g, g, value=1 - b2)
        u = (st["m"] / bc1) / ((st["v"] / bc2).sqrt() + eps)
    elif optimizer == "factored":
        st["m"].copy_(st["m"].float().lerp_(g, (1 - b1) * w))
        m = st["m"].float()  # the step reads the moment as it is kept, in bf16, as the fused CUDA step does
        row2, col2 = g2.mean(-1), g2.mean(-2)
        if scale2 is not None:
            row2, col2 = row2 * scale2, col2 * scale2
        st["v_row"].mul_(1 - (1 - b2) * w_rows).add_(row2, alpha=1 - b2)
        st["v_col"].mul_(1 - (1 - b2) * w_rows).add_(col2, alpha=1 - b2)
        v = st["v_row"].unsqueeze(-1) * st["v_col"].unsqueeze(-2) / st["v_row"].mean(-1, keepdim=True).unsqueeze(-1).clamp_min(1e-30)
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
    else:
        u = g / (g.pow(2).mean(dims, keepdim=True).sqrt() + eps)
    rms = u.pow(2).mean(dims, keepdim=True).sqrt()
    if update_clip > 0 and optimizer != "plain":  # plain's step has RMS 1 by construction
        u = u / (rms / update_clip).clamp_min(1.0)
    z = st["z"]
    step = -eta * w * u
    saturated = ((z.abs() >= clamp) & (step * z > 0)).sum()  # pushing past the clamp: no effect
    z.add_(step)
    clamped = (z.abs() > clamp).sum()
    z.clamp_(-clamp, clamp)
    new = torch.where(z > hyst, 1.0, torch.where(z < -hyst, -1.0, p))
    flips = (new != p).sum()
    p.copy_(new)
    return torch.stack([flips, saturated, clamped, bad.sum(), clipped]), (rms.flatten() * finite).max().float()


def sign_reference(grams: Path, teacher_cmf: CmfFile, teacher):
    """`init: margin`'s reference: the teacher model's weight and the FIT input Gram of each body linear,
    read one linear at a time, after checking that the Grams are the teacher's."""
    check_grams(grams, teacher_cmf)
    weights = dict(teacher.named_parameters())

    def reference(name: str):
        body = parse_body_linear(name)
        if body is None:
            return None
        return weights[name], torch.from_numpy(read_grams(grams, body[0], ROLE_INPUT[body[1]])[0])
    return reference


def buckets(keys: dict[str, tuple[int | None, tuple[int, ...]]]) -> list[list[str]]:
    """Group sign matrices (key → (layer, shape)) into buckets: one shape, `BUCKET_LAYERS` consecutive layers."""
    groups: dict[tuple, list[str]] = {}
    for key, (layer, shape) in keys.items():
        groups.setdefault((shape, -1 if layer is None else layer // BUCKET_LAYERS), []).append(key)
    return list(groups.values())



def remove_hooks(hooks: list) -> None:
    """Removes gradient hooks (removing one twice does nothing)."""
    for hook in hooks:
        hook.remove()

class SignTrainer:
    """The latents and optimizer state of every sign matrix, updated bucket by bucket from inside the
    backward pass; a training mode of `nvg.distill.Distiller` (its hooks are documented there)."""

    name = "signs"

    def __init__(self, linears: dict, settings: SignSettings, total_steps: int, group, reference=None):
        """`linears`: the BLR linears whose signs train, by CMF name (`Llama.blr_linears()`, or one block's).
        `reference(name)`: the teacher's weight and input Gram of a BLR linear (None where there is no
        Gram, which keeps those latents uniform); needed by `init: margin`."""
        assert settings.init == "uniform" or reference is not None, "init: margin needs the teacher's weights and Grams"
        self.s, self.group = settings, group
        self.eta0 = settings.peak_eta(total_steps)
        self.eta = 0.0  # set before every backward pass by `begin_step`
        self.mats: dict[str, torch.nn.Parameter] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # each matrix's dtype before training: `release` puts it back
        self.role: dict[str, str] = {}
        where = {}
        for name, m in linears.items():
            body = parse_body_linear(name)
            for part in ("su", "sv"):
                key = f"{name}:{part}"
                # the student keeps its signs in bf16; their straight-through gradients, summed over every
                # token, need float32 (bf16 ones solve the toy problem of tests/test_sign_training.py worse)
                self.dtypes[key] = getattr(m, part).dtype
                getattr(m, part).data = getattr(m, part).data.float()
                self.mats[key] = getattr(m, part)
                self.role[key] = body[1] if body else "other"
                where[key] = (body[0] if body else None, tuple(self.mats[key].shape))
        self.buckets = []  # (keys, the stacked bits, the stacked latents and optimizer state)
        for keys in buckets(where):
            bits = torch.stack([self.mats[k].detach() for k in keys])
            for j, k in enumerate(keys):  # each matrix becomes a view of its bucket's bits: the update writes them in place
                self.mats[k].data = bits[j]
            self.buckets.append((keys, bits, self._fresh(bits)))
        self.bucket_of = {key: i for i, (keys, _, _) in enumerate(self.buckets) for key in keys}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}  # bucket → the gradients that have arrived this step
        # each matrix's latents and optimizer state: views into its bucket's stacked tensors
        self.latents = {key: {n: t[keys.index(key)] for n, t in st.items()} for keys, _, st in self.buckets for key in keys}
        if settings.init == "margin":
            for name, m in linears.items():
                ref = reference(name)
                if ref is None:
                    continue
                for part, margin in zip(("su", "sv"), gram_margin(m, *ref)):
                    self.latents[f"{name}:{part}"]["z"].copy_(getattr(m, part) * margin_magnitudes(margin, settings))
        self.counters = {"sign_steps": 0, "eta_mul": 1.0, "hi_streak": 0, "bad_evals": 0,
                         "flips_total": 0, "saturated_total": 0, "clamped_total": 0,
                         "peaked": False, "flip_means": [], "spike_mul": 1.0, "quiet_steps": 0, "spikes": 0}
        self.live = sum(p.numel() for p in self.mats.values())
        dev = next(iter(self.mats.values())).device if self.mats else torch.device("cpu")
        self._counts = torch.zeros(5, dtype=torch.int64, device=dev)  # this step's flips, saturated, clamped, non-finite,
        # matrices whose gradient grad_clip scaled down
        self._step_rms = torch.zeros((), device=dev)  # this step's largest matrix step RMS before the clip
        self._scalars = torch.zeros(5, device=dev)  # η, the straight-through factor, Adam's bias corrections: begin_step
        # The hooks reach the trainer through a weak reference: a tensor's hooks live where Python's cyclic collector
        # does not look, so a strong one kept every dropped trainer, its latents and its state allocated for good
        # (bench/gpu_bench.py's next mode measured them in its peak, session 34). The finalizer removes them with
        # a trainer dropped without `release`, so no later backward calls a hook whose trainer is gone.
        arrived = weakref.WeakMethod(self._arrived)
        self.hooks = []
        for key, p in self.mats.items():
            p.requires_grad_(True)
            self.hooks.append(p.register_post_accumulate_grad_hook(lambda p, key=key: arrived()(key, p)))
        weakref.finalize(self, remove_hooks, self.hooks)

    @torch.no_grad()
    def release(self) -> None:
        """Training is over (reconstruction moves on to the next block): every sign matrix frozen, in its
        own storage and its dtype from before, the hooks removed, the latents and their state freed.
        `snapshot` and `restore` still work; nothing else does."""
        remove_hooks(self.hooks)
        for key, p in self.mats.items():
            p.requires_grad_(False)
            p.data = p.data.to(self.dtypes[key], copy=True)
        self.hooks, self.buckets, self.latents, self.pending = [], [], {}, {}

    def _fresh(self, p: torch.Tensor) -> dict:
        st = {"z": p.detach() * self.s.tau, "orig": p.detach() > 0}
        if self.s.optimizer == "adam":
            st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
        elif self.s.optimizer == "factored":
            st["m"] = torch.zeros_like(p, dtype=torch.bfloat16)
            st["v_row"] = torch.zeros(p.shape[:-1], device=p.device)
            st["v_col"] = torch.zeros((*p.shape[:-2], p.shape[-1]), device=p.device)
        return st

    @property
    def bytes_per_sign(self) -> int:
        return BYTES_PER_SIGN[self.s.optimizer] + 1

    def describe(self) -> str:
        s = self.s
        return (f"sign training: {self.live} signs in {len(self.mats)} matrices, optimizer {s.optimizer} "
                f"({self.bytes_per_sign} B/sign state ≈ {self.live * self.bytes_per_sign / 1e9:.2f} GB), latents {s.init} τ {s.tau}, "
                f"η0 {self.eta0:.3e}{' (auto min(0.15·τ/√steps, 4e-3·τ))' if s.eta is None else ''}, warm {s.warm} sign steps")

    def begin_step(self, shape: float, gscale: float) -> float:
        """Set η for the coming backward pass from the schedule shape; returns it."""
        c = self.counters
        s, t = self.s, c["sign_steps"] + 1
        c["peaked"] = c["peaked"] or shape >= 1.0  # the schedule's warm-up is over: flips from here on are the baseline
        self.eta = 0.0 if t <= s.warm else self.eta0 * c["eta_mul"] * c["spike_mul"] * shape
        # one host-to-device copy a step
        self._scalars = torch.tensor([self.eta, 2.0 / s.tau / gscale, 1 - s.b1**t, 1 - s.b2**t, 1 - s.b2**(t - 1)],
                                     device=self._counts.device)
        self._counts.zero_()
        self._step_rms.zero_()
        return self.eta

    def _arrived(self, key: str, p: torch.nn.Parameter) -> None:
        """A matrix's gradient is ready: keep it, and update its bucket once the bucket's last one is."""
        i = self.bucket_of[key]
        grads = self.pending.setdefault(i, {})
        grads[key] = p.grad
        p.grad = None
        if len(grads) == len(self.buckets[i][0]):
            self._update(i, self.pending.pop(i))

    @torch.no_grad()
    def _update(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        keys, bits, st = self.buckets[i]
        g = torch.stack([grads[k] for k in keys])
        if self.group.world > 1:
            g = self.group.sum(g) / self.group.world
        counts, step_rms = latent_step(self.s.optimizer, g, bits, st, self._scalars, self.s.b1, self.s.b2,
                                       self.s.eps, self.s.hyst, self.s.clamp, self.s.update_clip, self.s.grad_clip)
        self._counts += counts
        torch.maximum(self._step_rms, step_rms, out=self._step_rms)

    def end_step(self) -> dict:
        """After the backward pass: this step's counts (one host synchronisation)."""
        if self.pending:  # every sign matrix takes part in every forward pass, so every bucket completes
            raise RuntimeError(f"sign training: buckets {sorted(self.pending)} got only part of their gradients this step")
        c = self.counters
        *counts, step_rms = torch.cat([self._counts.double(), self._step_rms.double().view(1)]).tolist()
        flips, sat, clamped, nonfinite, grad_clipped = map(int, counts)  # < 2^53: exact in float64
        c["sign_steps"] += 1
        c["flips_total"] += flips
        c["saturated_total"] += sat
        c["clamped_total"] += clamped
        return {"flips": flips, "flip_rate": flips / max(1, self.live), "nonfinite": nonfinite, "eta": self.eta,
                "step_rms": step_rms, "grad_clipped": grad_clipped}

    def after_step(self, step: dict) -> tuple[dict, str, list[str]]:
        """After a completed step: metric fields, the progress note and the step guards' lines."""
        return ({"sign_eta": step["eta"], "sign_flips": step["flips"], "sign_step_rms": step["step_rms"],
                 "sign_grad_clipped": step["grad_clipped"]},
                f"  η {step['eta']:.2e} flips {step['flips']} ({step['flip_rate']:.1e}) step RMS {step['step_rms']:.2f}"
                + (f" gradients clipped {step['grad_clipped']}/{len(self.mats)}" if self.s.grad_clip > 0 else ""),
                self.step_guards(step))

    def step_guards(self, step: dict) -> list[str]:
        """After a completed step: the flip-rate guard (η halved when the flip rate exceeded
        `max_step_flip` three steps running) and the spike guard (module docstring)."""
        c, s = self.counters, self.s
        lines = []
        if step["flip_rate"] <= s.max_step_flip:
            c["hi_streak"] = 0
        else:
            c["hi_streak"] += 1
            if c["hi_streak"] >= 3:
                c["eta_mul"] *= 0.5
                c["hi_streak"] = 0
                lines.append(f"guard: flip rate {step['flip_rate']:.2e} > {s.max_step_flip:.1e} for 3 steps — sign η halved (×{c['eta_mul']})")
        # the flips rise for some steps once η leaves 0 (the warm steps) and while the schedule warms up: the
        # mean starts after both (on the real teacher a block's flips rose from 0 to 3,239 a step in the ten
        # steps after its warm ones, then fell)
        if s.spike_ratio > 0 and c["peaked"] and c["sign_steps"] > s.warm + SPIKE_BASELINE:
            flips, means = step["flips"], c["flip_means"]  # the running mean after each of the last quiet steps
            if (len(means) > SPIKE_BASELINE and flips > s.spike_ratio * means[0]
                    and step["flip_rate"] > SPIKE_FLOOR):
                c["spike_mul"] *= 0.5
                c["quiet_steps"] = 0
                c["spikes"] += 1
                lines.append(f"guard: {flips} flips > {s.spike_ratio:g} × their mean {means[0]:.0f} ({SPIKE_BASELINE} "
                             f"quiet steps ago) — sign η halved (spike ×{c['spike_mul']})")
            else:
                means.append(flips if not means else SPIKE_DECAY * means[-1] + (1 - SPIKE_DECAY) * flips)
                del means[:-SPIKE_BASELINE - 1]
                c["quiet_steps"] += 1
                if c["spike_mul"] < 1.0 and c["quiet_steps"] >= SPIKE_BASELINE:
                    c["spike_mul"] = min(1.0, 2 * c["spike_mul"])
                    c["quiet_steps"] = 0
                    lines.append(f"spike guard: {SPIKE_BASELINE} steps without a spike — sign η doubled back (spike ×{c['spike_mul']})")
        return lines

    def stats(self) -> dict:
        """Per role and overall: distinct flipped fraction (bits that differ from the student's), churn
        (flips per distinct flip), saturated and clamped fractions of all sign updates; how often the spike
        guard fired."""
        per_role = {r: [0, 0] for r in ROLES}
        for key, p in self.mats.items():
            acc = per_role.setdefault(self.role[key], [0, 0])
            acc[0] += int(((p > 0) != self.latents[key]["orig"]).sum())
            acc[1] += p.numel()
        distinct = sum(a[0] for a in per_role.values())
        c = self.counters
        updates = max(1, self.live * c["sign_steps"])
        return {
            "flips": c["flips_total"], "distinct": distinct, "flipped_fraction": distinct / max(1, self.live),
            "churn": c["flips_total"] / max(1, distinct), "saturated_fraction": c["saturated_total"] / updates,
            "clamped_fraction": c["clamped_total"] / updates, "spikes": c["spikes"],
            "per_role": {r: a[0] / a[1] for r, a in per_role.items() if a[1]},
        }

    def after_eval(self, heldout_kl: float, best_kl: float) -> tuple[dict, list[str]]:
        """At an evaluation: the statistics (for the eval log) and the progress lines, after the two
        evaluation guards have had their say."""
        c, s = self.counters, self.s
        stats = self.stats()
        roles = ", ".join(f"{r} {100 * f:.2f}%" for r, f in stats["per_role"].items())
        lines = [f"signs: {100 * stats['flipped_fraction']:.3f}% flipped ({stats['distinct']}), churn {stats['churn']:.2f}, "
                 f"saturated {stats['saturated_fraction']:.2e}, clamped {stats['clamped_fraction']:.2e} of sign updates; {roles}"]
        if stats["flipped_fraction"] > s.max_total_flip:
            c["eta_mul"] *= 0.5
            lines.append(f"guard: {100 * stats['flipped_fraction']:.2f}% of signs flipped > {100 * s.max_total_flip:.1f}% "
                         f"— sign η halved (×{c['eta_mul']})")
        if heldout_kl > 1.05 * best_kl:
            c["bad_evals"] += 1
            if c["bad_evals"] >= 2:
                c["eta_mul"] *= 0.5
                c["bad_evals"] = 0
                lines.append(f"guard: held-out KL above 1.05× best twice — sign η halved (×{c['eta_mul']})")
        else:
            c["bad_evals"] = 0
        return {k: v for k, v in stats.items() if k != "flips"}, lines

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The current bits, 1 byte per sign (for the best snapshot)."""
        return {k: (p.detach() > 0).cpu() for k, p in self.mats.items()}

    @torch.no_grad()
    def restore(self, bits: dict[str, torch.Tensor]) -> None:
        for k, p in self.mats.items():
            p.copy_(bits[k].to(p.device).float() * 2 - 1)

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The resumable state: the bits and every latent's optimizer tensors, and the counters."""
        tensors = {f"bits/{k}": v for k, v in self.snapshot().items()}
        for k, st in self.latents.items():
            tensors.update({f"{n}/{k}": t.to("cpu", copy=True) for n, t in st.items()})  # copies: not views of a bucket
        return tensors, {"counters": dict(self.counters)}

    @torch.no_grad()
    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.counters = dict(meta["counters"])
        self.restore({k[len("bits/"):]: v for k, v in tensors.items() if k.startswith("bits/")})
        for k, st in self.latents.items():
            for n, t in st.items():
                t.copy_(tensors[f"{n}/{k}"])

    def provenance(self) -> dict:
        st = self.stats()
        return {"optimizer": self.s.optimizer, "init": self.s.init, "tau": self.s.tau, "eta0": self.eta0, "eta_final_multiplier": self.counters["eta_mul"],
                "spike_final_multiplier": self.counters["spike_mul"],
                "steps": self.counters["sign_steps"], "warm": self.s.warm, "hyst": self.s.hyst, "clamp": self.s.clamp, **st}
