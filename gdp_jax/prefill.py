"""Prefill entry point: chunked Gated Delta Product over whole sequences."""
from __future__ import annotations

import jax.numpy as jnp

from gdp_jax import _backends, _checks
from gdp_jax._prefill_bwd import BwdConfig, chunk_gated_delta_product_train
from gdp_jax._prefill_kernels import FwdConfig


def chunk_gated_delta_product(
    q, k, v, g=None, beta=None, *, num_householder, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, state=None,
    state_indices=None, return_chunk_states=False, chunk_states_dtype=None, config=None,
    bwd_config=None, backend="auto"):
  """Gated Delta Product prefill; matches `gdp_jax.reference.chunk_gated_delta_product`.

  Per sequence and value head, with state S [K, V] in float32, for each token t:
  `S *= exp(g_t)`, then for j in 0..M-1 with row r = t*M + j:
  `S += k_r (beta_r * (v_r - S^T k_r))^T`, then `o_t = S^T (scale * q_t)`.
  The kernels run it in 64-row chunks (WY form), docs/algorithm.md §4.

  Args:
    q: queries [B, T, H, K].
    k: keys of the Householder-expanded stream, [B, T*M, H, K]; token t owns rows
      t*M .. t*M+M-1.
    v: values [B, T*M, HV, V]; value head hv reads key head hv // (HV // H).
    g: log decays [B, T, HV] (natural log, <= 0), one per token, or None for no decay.
    beta: [B, T*M, HV], or None for 1.
    num_householder: M, the rank-1 updates per token.
    scale: query scale; None means K ** -0.5.
    initial_state: [N, HV, K, V], any float dtype, or None for zeros.
    output_final_state: return the final state [N, HV, K, V] float32 (without `state`).
    use_qk_l2norm_in_kernel: normalise q and k rows, x / sqrt(sum(x^2) + 1e-6).
    cu_seqlens: [N+1] int32 token starts of packed sequences (B == 1), or None. Tokens after
      cu_seqlens[N] get o = 0.
    state: cache [S, HV, K, V]; sequence n reads and writes slot state_indices[n] (or n).
    state_indices: [N] int32; a slot outside [0, S) (-1) is padding: no read, no write, o = 0,
      chunk states 0. Slots must be unique within a call.
    return_chunk_states: also return the state entering every 64-token chunk, for prefix caching:
      [B, ceil(T/64), HV, K, V] dense, or [min(T, T//64 + N), HV, K, V] packed, where row
      `gdp_jax.chunk_offsets(cu_seqlens)[n] + c` is sequence n after its first 64c tokens and
      rows past the last sequence are 0.
    chunk_states_dtype: dtype of those snapshots; None means the cache dtype, else
      initial_state's, else k's. float32 keeps full precision.
    config: a `gdp_jax.FwdConfig` (the forward kernels' tiles, warps and scan split, for the
      plain and the training forward), or None for the defaults. Static: another config is
      another compiled program. Under any one config a request gets the same bits whatever it
      is batched with; a config chosen per batch (say `FwdConfig(h_piece=0)`, never split,
      where the batch fills the GPU) gives up that invariance (docs/api.md, "Kernel configs").
    bwd_config: a `gdp_jax.BwdConfig` (the backward kernels', under differentiation), or None
      for the defaults. Both configs are checked on every backend; backend="reference" ignores
      them.
    backend: "auto", "triton", "reference" or "interpret" (see README).

  Returns:
    (o, final_state), plus chunk_states last when return_chunk_states. o is [B, T, HV, V] in
    v.dtype. final_state is the updated cache when `state` is given (a new array; the same
    buffer when donated under jax.jit), else [N, HV, K, V] float32 when output_final_state, else
    None.

  Raises:
    ValueError: at trace time, for shapes or dtypes that do not fit the above, or a config
      of another type or with a field the kernels cannot take.
    NotImplementedError: float64 (or another non-16/32-bit float) keys on a kernel backend.
  """
  dims = _checks.check_prefill(
      q, k, v, g, beta, num_householder=num_householder, scale=scale,
      initial_state=initial_state, cu_seqlens=cu_seqlens, state=state,
      state_indices=state_indices, chunk_states_dtype=chunk_states_dtype, config=config,
      bwd_config=bwd_config)
  scale = dims.K ** -0.5 if scale is None else float(scale)
  backend = _backends.resolve(backend)
  arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                cu_seqlens=cu_seqlens, state=state, state_indices=state_indices)
  static = dict(num_householder=num_householder, scale=scale,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                return_chunk_states=return_chunk_states, chunk_states_dtype=chunk_states_dtype)
  if backend == "reference":
    from gdp_jax import reference
    return _backends.call_jitted(reference.chunk_gated_delta_product, arrays, **static)
  if k.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    # The chunked kernels multiply in the dtype of k (tensor cores for 16-bit, ieee float32
    # dots for float32); other dtypes have no tested path there.
    raise NotImplementedError(
        f"backend={backend!r}: the chunked kernels take bfloat16, float16 or float32 keys, got "
        f"{k.dtype}; cast the inputs, or use backend='reference' for float64")
  # None and the default config are one jit program.
  return _backends.call_jitted(
      chunk_gated_delta_product_train, arrays, backend=backend,
      config=FwdConfig() if config is None else config,
      bwd_config=BwdConfig() if bwd_config is None else bwd_config, **static)
