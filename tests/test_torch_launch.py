"""The kernels are framework-neutral: the same @triton.jit function, launched from torch and from
JAX on the same inputs with the same config, writes the same bits.

On a GPU both sides compile (torch's launcher, jax_triton); on a CPU both run the kernel through
Triton's interpreter (torch CPU tensors, and gdp_jax's "interpret" backend), which checks the
calling convention wherever torch is installed. The torch side is what a torch launcher does: it passes an
in-place buffer (the cache) twice, as the input and as the output pointer, and a placeholder
tensor plus a constexpr flag for every optional input, exactly the calling convention that
jax-triton 0.3.1 imposes on the JAX side.

Under `--launch=xla_triton` the JAX side's kernel is compiled by the Triton that XLA bundles, not
by pip's triton that torch's launcher uses: another compiler, so the bits may differ
(docs/performance.md, launch cost). There the check is the same calling convention with results
equal to float32 rounding instead.
"""
import os

import numpy as np
import pytest

import gdp_jax
from conftest import KERNEL_BACKEND, LAUNCH
from gdp_jax import _configs
from helpers import bits_equal

GPU = KERNEL_BACKEND == "triton"
DEVICE = "cuda" if GPU else "cpu"
# Both variants: the compiled one is marked gpu (selected with -m gpu on the H200); the
# interpreted one needs no GPU, only torch (not in the test extra: skipped where it is missing).
BACKEND = pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=pytest.mark.gpu), "interpret"])


def _torch(backend):
  if (backend == "triton") != GPU:
    pytest.skip(f"backend {backend!r} does not run on this machine ({KERNEL_BACKEND} does)")
  torch = pytest.importorskip("torch", reason="launching from torch needs torch installed")
  # jax_triton clears TRITON_CACHE_DIR on import; torch's launcher needs a cache directory.
  if GPU and not os.environ.get("TRITON_CACHE_DIR"):
    os.environ["TRITON_CACHE_DIR"] = os.path.expanduser("~/.triton/cache")
  return torch


def _same(a, b, backend, rtol=1e-6) -> bool:
  """Bitwise equal when one compiler built both sides; when XLA's Triton built the JAX side, to
  the rounding of the stored dtype (rtol of the largest magnitude: 1e-6 for float32, 2**-7,
  one bfloat16 step, for bfloat16 outputs)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  if backend == "triton" and LAUNCH["path"] == "xla_triton":
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= rtol * np.max(np.abs(b))))
  return bits_equal(a, b)


def _inputs(N, T, H, HV, K, V, S, seed):
  """bf16-representable values as float32 numpy, so both frameworks get identical bf16 inputs."""
  import ml_dtypes
  rng = np.random.default_rng(seed)
  bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)
  slots = rng.permutation(S)[:N].astype(np.int32)
  slots[0] = -1
  return dict(q=bf(rng.standard_normal((N, T, H, K))), k=bf(rng.standard_normal((N, T, H, K))),
              v=bf(rng.standard_normal((N, T, HV, V))),
              g=-rng.exponential(0.3, (N, T, HV)).astype(np.float32),
              beta=bf(rng.uniform(0, 1, (N, T, HV))),
              cache=rng.standard_normal((S, HV, K, V)).astype(np.float32), slots=slots)


@BACKEND
@pytest.mark.parametrize("shape", [(8, 5, 4, 8, 128, 128), (4, 3, 2, 2, 256, 512)],
                         ids=["N8-T5-H4-HV8-K128-V128", "N4-T3-H2-HV2-K256-V512"])
def test_fused_recurrent_same_bits_from_torch_and_jax(shape, backend):
  torch = _torch(backend)
  if backend == "interpret":
    shape = (3, 3, 1, 2, 16, 16)  # the interpreter is slow
  import jax.numpy as jnp
  from gdp_kernels.fused_recurrent import fused_recurrent_fwd_kernel
  N, T, H, HV, K, V = shape
  S = N + 3
  x = _inputs(N, T, H, HV, K, V, S, seed=1)
  scale = float(np.float32(K ** -0.5))

  jx = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items() if n in ("q", "k", "v", "beta")}
  o_jax, cache_jax = gdp_jax.fused_recurrent_gated_delta_rule(
      **jx, g=jnp.asarray(x["g"]), scale=scale, use_qk_l2norm_in_kernel=True,
      state=jnp.asarray(x["cache"]), state_indices=jnp.asarray(x["slots"]), backend=backend)

  dev = DEVICE
  tt = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dev).to(dt)
  q, k, v, beta = (tt(x[n], torch.bfloat16) for n in ("q", "k", "v", "beta"))
  g = tt(x["g"], torch.float32)
  cache = tt(x["cache"], torch.float32)
  slots = tt(x["slots"], torch.int32)
  ph, ph_i = torch.zeros(1, device=dev), torch.zeros(1, device=dev, dtype=torch.int32)
  o = torch.full((N, T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16)
  cfg = _configs.decode_config(K, V)
  BK = 1 << (K - 1).bit_length()
  fused_recurrent_fwd_kernel[(-(-V // cfg.BV) * N * HV,)](
      q, k, v, g, beta, ph, cache, ph, slots, ph_i, ph_i, ph, ph, ph, ph, scale, T, S,
      o, ph, cache, ph,
      H=H, HV=HV, K=K, V=V, NI=1, NR=1, BK=BK, BV=cfg.BV, STEPS_PER_TOKEN=1, RING_G_STEPS=1,
      USE_G=True, USE_BETA=True, IS_BETA_HEADWISE=True, USE_QK_L2NORM=True,
      USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, HAS_STATE=True, HAS_STATE_INDICES=True,
      STORE_INTERMEDIATE=False, IS_VARLEN=False, HAS_NUM_ACCEPTED=False, HAS_REPLAY=False,
      BT=0, NC=1,
      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  if GPU:
    torch.cuda.synchronize()
  assert _same(np.asarray(o_jax.astype(jnp.float32)), o.float().cpu().numpy(), backend,
               rtol=2 ** -7)
  assert _same(np.asarray(cache_jax), cache.cpu().numpy(), backend)


@BACKEND
def test_prefill_kkt_same_bits_from_torch_and_jax(backend):
  """A prefill stage too: chunk_kkt as the prefill launches it by default (stages 2 and 3 in one
  program: Ai, the decay cumsum Gx and the key row factors) over two packed sequences, from
  torch and through the JAX launcher, with the launch's own constexprs, warps and stages."""
  torch = _torch(backend)
  import jax.numpy as jnp
  from gdp_jax import _prefill_kernels as pk
  from gdp_jax import reference
  from gdp_kernels.chunk_kkt import chunk_kkt_fwd_kernel
  lens, H, HV, K, M = ((700, 300), 4, 8, 128, 2) if backend == "triton" else ((50, 20), 1, 2, 32, 2)
  T = sum(lens)
  x = _inputs(1, T * M, H, HV, K, 16, 1, seed=3)
  k = x["k"][0]
  beta, g = x["beta"][0], x["g"][0, :T]
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  desc = np.array(reference.chunk_descriptors(jnp.asarray(cu * M), (T * M) // 64 + len(lens)))

  cfg = pk.FwdConfig()
  call = pk._kkt_launch(jnp.asarray(k, jnp.bfloat16), jnp.asarray(beta, jnp.bfloat16),
                        jnp.asarray(g), jnp.asarray(cu), jnp.asarray(desc), HV=HV, M=M,
                        l2norm=True, config=cfg, solve=True)
  Ai_jax, gx_jax, rk_jax, _ = call.run(backend)

  dev = DEVICE
  tt = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dev).to(dt)
  Ai = torch.full((T * M, HV, 64), float("nan"), dtype=torch.bfloat16, device=dev)
  gx = torch.full((T * M, HV), float("nan"), device=dev)
  rk = torch.full((T * M, H), float("nan"), device=dev)
  kn = torch.zeros((1,), dtype=torch.bfloat16, device=dev)   # the training forward's output
  chunk_kkt_fwd_kernel[call.grid](
      tt(k, torch.bfloat16), tt(beta, torch.bfloat16), tt(g, torch.float32),
      tt(cu, torch.int32), tt(desc, torch.int32), Ai, gx, rk, kn, **call.constexprs,
      num_warps=call.num_warps, num_stages=call.num_stages)
  if GPU:
    torch.cuda.synchronize()
  for name, a, b in (("Ai", Ai_jax, Ai), ("Gx", gx_jax, gx), ("rk", rk_jax, rk)):
    assert _same(np.asarray(a, np.float32), b.float().cpu().numpy(), backend), name
